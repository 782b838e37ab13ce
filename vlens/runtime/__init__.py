"""What runs inside vLLM's worker: the leaf package of vlens.

Sites on modules, per-request narrowing, hook calls, the graph tier's traced hooks and what
crosses to and from the user's process, with the vocabulary they need: where a value lives
(:mod:`~vlens.runtime.locations`), how it is read and written back (:mod:`~vlens.runtime.readers`)
and steering as data (:mod:`~vlens.runtime.steering`). A vLLM worker process imports this package
and nothing else of vlens (``tests/engine/test_tensor_parallel.py`` checks it), so nothing here imports
the user's side. Under tensor parallelism every worker process holds its own
:class:`~vlens.runtime.worker.WorkerRuntime`.
"""
