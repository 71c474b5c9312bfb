"""KVDirect (paper 001, sections 4.1-4.2): pull-mode, tensor-centric KV transfer over one-sided reads."""
