"""Sites: torch hooks on vLLM's modules that hand each followed request its own rows
(:mod:`~vlens.runtime.sites.torch_hooks`), on the operations inside a module's forward
(:mod:`~vlens.runtime.sites.source`), the probe of which modules really run
(:mod:`~vlens.runtime.sites.probe`), and SAEs spliced in at a site
(:mod:`~vlens.runtime.sites.splices`)."""
