"""What runs inside vLLM's worker: sites on modules, per-request narrowing, captured values.

Nothing here runs in the user's process by assumption: under tensor parallelism every worker
process holds its own :class:`~vlens.runtime.worker.WorkerRuntime`.
"""
