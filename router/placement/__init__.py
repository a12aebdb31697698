"""Where a model's worker runs besides the router's own box: a Ray cluster (`omni-router --ray`).

One lifecycle (router.lifecycle), two ways to run a worker: a local subprocess, or a Ray actor
that starts the same argv as a subprocess on its node. Imported only with `--ray`: a single-box
user never imports ray.

    nodes        the cluster's nodes as the router sees them, and which may take a model (pure)
    ray_actor    the actor on a node: spawns the worker, streams its log tail, measures, stops it
    ray_process  the router's side of one actor: a `Process` (exit, log tail, stop)
    ray_cluster  the driver connection, per-node admission, and the effects that place a worker
"""
