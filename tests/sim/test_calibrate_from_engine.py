"""Calibration from an engine in service: `kvmesh sim calibrate --from-engine URL` fits the step cost
to the steps the engine recorded (GET /v1/steps), and the request's path outside the engine is two
measured terms that move the simulated tokens to when the client has them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from kvmesh.policies.step_shape import FIELDS
from kvmesh.sim.fit import fit_engine_steps
from kvmesh.sim.request import SimRequest
from kvmesh.sim.request_path import RequestPath, delivered, load_request_path, measure, profile_entry
from kvmesh.sim.step_cost import TERMS, StepCost, load_profile, write_profile

TRUTH = StepCost(a=2e-3, b=5e-5, c=8e-5, d=3e-7, e=1e-7, f=3e-3)


def recorded_steps(count: int = 60) -> list[dict]:
    """Steps as GET /v1/steps lists them, timed exactly by TRUTH."""
    rng = np.random.default_rng(1)
    steps = []
    for i in range(count):
        shape = (int(rng.integers(0, 512)), int(rng.integers(0, 16)), int(rng.integers(0, 20_000)),
                 int(rng.integers(0, 100_000)), int(rng.integers(0, 8)))
        steps.append({"index": i + 1, "end": 1000.0 + i, "seconds": TRUTH.seconds(*shape),
                      **dict(zip(FIELDS, shape))})
    return steps


@pytest.fixture
def engine_url():
    """A stand-in for an engine service: GET /v1/steps?since=N answers the recorded steps after N."""
    steps, seen = recorded_steps(), []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append((self.path, self.headers.get("Authorization")))
            since = int(self.path.partition("since=")[2] or 0)
            body = json.dumps({"steps": [s for s in steps if s["index"] > since], "recorded": len(steps),
                               "capacity": 16384}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", seen
    server.shutdown()


def test_calibrate_from_engine_fits_the_engine_s_recorded_steps(engine_url, tmp_path):
    url, seen = engine_url
    out = tmp_path / "served.json"
    done = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "calibrate", "--from-engine", url, "--since", "10",
                           "--out", str(out)], capture_output=True, text=True, env={"KVMESH_TOKEN": "t0k",
                                                                                   "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    cost = load_profile(str(out))
    for term in TERMS:
        assert getattr(cost, term) == pytest.approx(getattr(TRUTH, term), rel=1e-6)
    body = json.loads(out.read_text())
    assert body["fit"]["samples"] == 50 and "steps" not in body["fit"]
    assert seen == [("/v1/steps?since=10", "Bearer t0k")]


def test_calibrate_from_engine_needs_a_profile_to_write(engine_url):
    done = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "calibrate", "--from-engine", engine_url[0]],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "give --out" in done.stderr


def test_the_fit_to_scattered_steps_gets_their_total_time_right():
    """A shared CPU holds one step in four up by 5 ms: the fit's steps add up to the measured ones."""
    steps = recorded_steps(200)
    for step, held in zip(steps, np.random.default_rng(2).choice([0.0, 0.0, 0.0, 5e-3], len(steps))):
        step["seconds"] += held
    cost, fit = fit_engine_steps(steps)
    assert fit["fitted_s"] == pytest.approx(fit["measured_s"], rel=1e-9)
    assert fit["measured_s"] == pytest.approx(sum(s["seconds"] for s in steps))
    assert fit["held_at_zero"] == [] and cost.a > TRUTH.a


def test_the_path_is_the_client_s_figures_minus_the_engine_s():
    path = measure(ttft_s=[0.050, 0.070], e2e_s=[0.200, 0.300], engine_first_token_s=[0.040, 0.056],
                   engine_decode_s=[0.140, 0.220])
    assert path.first_token_s == pytest.approx((0.010 + 0.014) / 2)
    assert path.last_token_lag_s == pytest.approx((0.010 + 0.010) / 2)


def test_delivery_moves_the_first_token_and_the_rest_later_still():
    r = SimRequest("r", arrival=1.0, prompt_len=8, max_tokens=3, token_times=[1.1, 1.2, 1.3], finished_at=1.3)
    delivered([r], RequestPath(first_token_s=0.01, last_token_lag_s=0.002))
    assert r.token_times == pytest.approx([1.11, 1.212, 1.312]) and r.finished_at == pytest.approx(1.312)


def test_a_profile_carries_its_path_and_one_without_has_none(tmp_path):
    path = RequestPath(first_token_s=0.007, last_token_lag_s=0.001)
    with_path, without = tmp_path / "a.json", tmp_path / "b.json"
    write_profile(with_path, TRUTH, dict.fromkeys(TERMS, "test"), {"request_path": profile_entry(path, "test")}, {})
    write_profile(without, TRUTH, dict.fromkeys(TERMS, "test"), {}, {})
    assert load_request_path(str(with_path)) == path
    assert load_request_path(str(without)) == RequestPath()
