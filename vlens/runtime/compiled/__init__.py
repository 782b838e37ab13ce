"""A compiled engine: sites traced into vLLM's compiled graph, reading and steering through
static buffers (:mod:`~vlens.runtime.compiled.graph`, :mod:`~vlens.runtime.compiled.buffers`),
installed when the workers load the model (:mod:`~vlens.runtime.compiled.workers`); the ops through
which the graph calls hook functions (:mod:`~vlens.runtime.compiled.hook_sites`) and full CUDA
graphs that break there (:mod:`~vlens.runtime.compiled.breaks`); SAEs in the graph
(:mod:`~vlens.runtime.compiled.saes`); a served request's plan carried inside it
(:mod:`~vlens.runtime.compiled.inline`)."""
