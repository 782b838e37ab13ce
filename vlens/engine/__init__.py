"""One call, from plan to engine to cache: a model's checkpoint without its engine
(:mod:`vlens.engine.checkpoint`), a call's meaning and its plans for the workers
(:mod:`vlens.engine.planning`), vLLM's engine and the route to its workers
(:mod:`vlens.engine.engine`, built with :mod:`vlens.engine.arguments`), and the values assembled
from what the workers hand back (:mod:`vlens.engine.assembly`)."""
