"""Serving one model over several processes or hosts with MLX distributed (pipeline parallel).

Rank 0 owns the whole engine (scheduler, sampling, MTP head, embeddings, final norm and
lm_head, the first layers); every other rank is a worker that holds a contiguous slice of
the trunk's layers and nothing else. A trunk forward goes once around the ring
0 -> 1 -> ... -> n-1 -> 0, so a verify of K+1 tokens crosses the pipeline once per cycle and
drafting (on rank 0, which holds the head) costs no hop. The transport is `mx.distributed`
(ring over TCP, or whatever backend `mlx.launch` would pick); nothing here opens a socket.

Rooms: `hostfile` (the user's hosts.json, the ring's addresses), `split` (layers by memory),
`wire` (the messages on the ring), `stage` (running a slice of layers), `fingerprint` (what
must match across ranks), `worker` (a worker's main loop), `link` (rank 0's side, with
timeouts), `pipeline` (rank 0's trunk over the group), `launcher` (starting and stopping
workers), `run` (a rank 0 that runs requests from the command line: tests and benchmarks).
"""
