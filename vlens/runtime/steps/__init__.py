"""Engine steps: which rows of a step belong to which request, read from the model runner
(:mod:`~vlens.runtime.steps.layout`), and the rows of names read over whole steps, kept until
their requests finish (:mod:`~vlens.runtime.steps.kept_steps`)."""
