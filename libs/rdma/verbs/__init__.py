"""RDMA over a NIC (or Soft-RoCE) with pyverbs: reliable-connected queue pairs, NIC-registered memory.

pyverbs is imported only when an endpoint is made, so the package imports on machines without it;
`VerbsEndpoint.unavailable_reason()` says why the backend cannot run. The state machine, handshake
and work-request building (plan.py, handshake.py, work_requests.py) are plain data, tested without a device.
"""
