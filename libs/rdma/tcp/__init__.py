"""Software RDMA over TCP: a responder thread serves READs and WRITEs straight from registered memory."""
