"""A layer's attention computed explicitly in the worker, for hooks on scores, patterns and
per-head results (:mod:`~vlens.runtime.attention.explicit`): its arithmetic
(:mod:`~vlens.runtime.attention.arithmetic`) and each request's keys and values
(:mod:`~vlens.runtime.attention.kv_history`)."""
