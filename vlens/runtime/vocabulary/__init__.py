"""What mapping files and the user's side say to the workers: where a value lives in vLLM's
module tree (:mod:`~vlens.runtime.vocabulary.locations`), how TransformerLens's value is read from
one module call and written back (:mod:`~vlens.runtime.vocabulary.readers`), and steering as data
(:mod:`~vlens.runtime.vocabulary.steering`)."""
