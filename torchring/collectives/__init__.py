"""The collectives API: allreduce, broadcast, allgather and reduce_scatter with their checks and
CUDA dispatch (basic), the rooted and fused collectives (rooted), all-to-all (exchange),
send/recv (p2p) and the public Group (groups). ``torchring/__init__.py`` re-exports them."""
