"""TransformerLens hook functions at the sites: which requests of a step run them together
(:mod:`~vlens.runtime.hooks.batches`), calling them and writing their edits back
(:mod:`~vlens.runtime.hooks.calls`), and what a site does when it fires
(:mod:`~vlens.runtime.hooks.firing`)."""
