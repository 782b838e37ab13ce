"""What runs inside vLLM's worker: the leaf package of vlens.

A vLLM worker process imports this package and nothing else of vlens but the SAE numerics an SAE
it unpickles needs (``tests/engine/test_tensor_parallel.py`` checks it in spawned workers;
``tests/unit/test_layers.py`` keeps every import pointing down). Its rooms: the vocabulary it
shares with the user's side (:mod:`~vlens.runtime.vocabulary`), what crosses between the processes
(:mod:`~vlens.runtime.transfer`), engine steps and their rows (:mod:`~vlens.runtime.steps`), sites on
vLLM's modules (:mod:`~vlens.runtime.sites`), hook functions run at them
(:mod:`~vlens.runtime.hooks`), attention computed explicitly (:mod:`~vlens.runtime.attention`) and
a compiled engine's graph (:mod:`~vlens.runtime.compiled`). The hub is
:class:`~vlens.runtime.worker.WorkerRuntime`, one per worker.
"""
