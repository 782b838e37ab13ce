"""One call, from plan to engine to cache: building vLLM's engine (:mod:`vlens.engine.link`),
what it can serve (:mod:`vlens.engine.support`), a call's plans for the workers
(:mod:`vlens.engine.planning`), the memory a cache would take (:mod:`vlens.engine.memory_budget`)
and the cache assembled from what the workers hand back (:mod:`vlens.engine.cache`)."""
