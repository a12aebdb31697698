"""Each model's lifecycle: one owner task per model, effects that report by message, memory.

    state      `Phase` (the owner's state, its transition table) and the `ModelState` on the wire
    model      `ModelHandle`: the owner task, its commands and the hot-path admit/release
    request_queue  one model's waiting requests, the forwarding bound (slots + margin), the crash requeue
    preset_change  whether a reloaded preset needs the worker restarted
    hub_files  an `hf-repo` model's download (an owner's effect) and the preset its worker runs
    idle       the idle tiers: when an idle model sleeps, then unloads
    views      a model's card (`GET /v1/models`) and its memory view
    messages   what an owner receives: commands and effect reports
    effects    what an owner asks of the outside: spawn, readiness, sleep, wake, stop, memory samples
    process    one worker subprocess: argv, spawn, readiness, stop
    pool       every model by name and alias, wired together; reload
    admission  `--models-max` slots, memory, the FIFO of models waiting for one
    eviction   the pure eviction policy
    swap       the swap scheduler: which waiting model gets a slot next, and what makes room (pure)
    estimate   a model's memory need before it loads, and what measuring taught
    gguf_header  the few GGUF header keys the estimate needs (no vocabulary)
    modalities what a model takes as input (its mmproj's header) and whether it speaks, without loading it
    load_failure why a load failed, in one line, whether trying again can help, the crash backoff
    memory     a worker's measured RAM and VRAM
    gpus       the box's GPUs and each process's use of them (NVML or nvidia-smi): the leaf that asks
    gpu_placement  which GPUs a model runs on: the pure policy (docs/gpu-placement.md)
    gpu_book   what each model is charged on each GPU, each GPU's room (the reservations)
    gpu_admission  the GPU placement wired in: devices before a slot; the worker started on them
"""
