"""What the router shows of itself: metrics, logs, request traces, profiling.

    requests        the requests in flight: begin, admit, end (every request, proxied or translated)
    request_trace   one request's timeline and token counts
    metrics         GET /metrics: the router's series and every worker's
    logs            GET /logs and /logs/stream, and the one-line request log
    profiling       /start_profile and /stop_profile across the router and its workers
    profile_report  `omni-router profile-report DIR`
    gpu_metrics     `/metrics` gauges per GPU, from the GPU placement's latest figures
"""
