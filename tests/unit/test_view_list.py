"""The running requests' views a step hands the admission policy are built only as the policy reads
them (policies/iteration/view_list.py): FCFS reads none; a policy that reads them sees each request
as it is at the call."""

from kvmesh.policies.iteration.view_list import ViewList
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost


class Counted(SimRequest):
    built = 0

    def view(self):
        Counted.built += 1
        return super().view()


def test_views_are_built_once_each_when_read():
    requests = [Counted(f"r{i}", 0.0, 8 + i, 4) for i in range(3)]
    Counted.built = 0
    views = ViewList(requests)
    assert len(views) == 3 and Counted.built == 0
    assert views[1].prompt_len == 9 and views[-1].prompt_len == 10 and Counted.built == 2
    assert [v.request_id for v in views] == ["r0", "r1", "r2"] and [v.prompt_len for v in views[1:]] == [9, 10]
    assert Counted.built == 3 and views[0] is views[0]


def test_an_fcfs_step_builds_the_views_of_the_waiting_requests_only():
    engine = SimEngine(EngineSpec(), StepCost(a=0.01))
    for i in range(4):
        engine.add(Counted(f"r{i}", 0.0, 16, 8))
    engine.complete(engine.schedule(0.0), 0.01)
    engine.add(Counted("late", 0.005, 16, 8))
    Counted.built = 0
    step = engine.schedule(0.01)
    assert len(step.chunks) == 5 and Counted.built == 1
