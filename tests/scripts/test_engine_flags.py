"""scripts/engine_flags.py's reader on small wheels written the way the releases write their parsers."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "engine_flags.py"
_spec = importlib.util.spec_from_file_location("engine_flags", SCRIPT)
engine_flags = importlib.util.module_from_spec(_spec)
# Its dataclasses look their module up by name while being defined.
sys.modules[_spec.name] = engine_flags
_spec.loader.exec_module(engine_flags)


def _wheel(tmp_path: Path, files: dict[str, str], name: str = "engine-1.0-py3-none-any.whl") -> Path:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as z:
        for inside, text in files.items():
            z.writestr(inside, textwrap.dedent(text))
    return path


# vLLM 0.11-shaped: EngineArgs names each flag literally, the frontend derives
# its flags from dataclass fields, get_kwargs gives bools BooleanOptionalAction.
VLLM = {
    "vllm/engine/arg_utils.py": """
        import argparse
        from dataclasses import dataclass
        from typing import Optional
        from vllm.config import CacheConfig
        from vllm.utils import FlexibleArgumentParser

        def _compute_kwargs(cls):
            for field in fields(cls):
                if contains_type(type_hints, bool):
                    kwargs[name]["action"] = argparse.BooleanOptionalAction

        class EngineArgs:
            @staticmethod
            def add_cli_args(parser):
                cache_kwargs = get_kwargs(CacheConfig)
                group = parser.add_argument_group(title="CacheConfig")
                group.add_argument("--block-size", **cache_kwargs["block_size"])
                group.add_argument("--enable-prefix-caching", **cache_kwargs["enable_prefix_caching"])
                group.add_argument("--calculate-kv-scales", **{**cache_kwargs["calculate_kv_scales"], "default": None})
                group.add_argument("--tensor-parallel-size", "-tp", type=int)
                for arg, type in [("--old-backend", str), ("--old-switch", bool)]:
                    group.add_argument(arg, type=type, deprecated=True)
                parser.add_argument("--disable-log-stats", action="store_true")
                return parser

        class AsyncEngineArgs(EngineArgs):
            @staticmethod
            def add_cli_args(parser):
                parser = EngineArgs.add_cli_args(parser)
                parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction)
                current_platform.pre_register_and_update(parser)
                return parser
    """,
    "vllm/config/__init__.py": "from vllm.config.cache import CacheConfig\n",
    "vllm/config/cache.py": """
        from typing import Optional
        from pydantic import SkipValidation

        class CacheConfig:
            block_size: SkipValidation[int] = None
            enable_prefix_caching: Optional[bool] = None
            calculate_kv_scales: SkipValidation[bool] = False
    """,
    "vllm/entrypoints/openai/cli_args.py": """
        from typing import Optional
        from vllm.engine.arg_utils import AsyncEngineArgs

        class FrontendArgs:
            host: Optional[str] = None
            port: int = 8000
            allow_credentials: bool = False
            middleware: list[str] = None

            @staticmethod
            def add_cli_args(parser):
                frontend_kwargs = get_kwargs(FrontendArgs)
                for key, value in frontend_kwargs.items():
                    parser.add_argument(f"--{key.replace('_', '-')}", **value)
                return parser

        def make_arg_parser(parser):
            parser.add_argument("model_tag", nargs="?")
            parser.add_argument("--headless", action="store_true")
            parser = FrontendArgs.add_cli_args(parser)
            parser = AsyncEngineArgs.add_cli_args(parser)
            return parser
    """,
    "vllm/entrypoints/cli/serve.py": """
        from vllm.entrypoints.openai.cli_args import make_arg_parser

        class ServeSubcommand:
            name = "serve"

            def subparser_init(self, subparsers):
                return make_arg_parser(subparsers.add_parser("serve"))
    """,
    "vllm/platforms/interface.py": """
        class Platform:
            @classmethod
            def pre_register_and_update(cls, parser=None):
                pass
    """,
    "vllm/platforms/cuda.py": "class CudaPlatform:\n    pass\n",
    "vllm/utils/__init__.py": """
        from argparse import ArgumentParser

        class FlexibleArgumentParser(ArgumentParser):
            def add_argument(self, *args, **kwargs):
                kwargs.pop("deprecated", False)
                return super().add_argument(*args, **kwargs)
    """,
}

VLLM_FLAGS = {
    "--headless",
    "--host",
    "--port",
    "--allow-credentials",
    "--no-allow-credentials",
    "--middleware",
    "--block-size",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--calculate-kv-scales",
    "--no-calculate-kv-scales",
    "--tensor-parallel-size",
    "-tp",
    "--old-backend",
    "--old-switch",
    "--disable-log-stats",
    "--enable-log-requests",
    "--no-enable-log-requests",
}


def test_vllm_flags_literal_derived_and_negated(tmp_path):
    flags = engine_flags.read("vllm", _wheel(tmp_path, VLLM))
    assert flags.names == VLLM_FLAGS
    assert ("--tensor-parallel-size", "-tp") in flags.aliases
    assert "entry: vllm serve (vllm/entrypoints/cli/serve.py, parser from vllm/entrypoints/openai/cli_args.py)" in (
        flags.facts
    )
    assert flags.facts[-1].startswith("abbreviations: on")


def test_vllm_enable_disable_action_adds_the_inverse_names(tmp_path):
    files = dict(VLLM)
    files["vllm/utils/__init__.py"] = """
        from argparse import ArgumentParser, BooleanOptionalAction

        class EnableDisableAction(BooleanOptionalAction):
            _inverse_prefixes = {"--enable-": "--disable-", "--disable-": "--enable-"}

        class FlexibleArgumentParser(ArgumentParser):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.register("action", BooleanOptionalAction, EnableDisableAction)
    """
    flags = engine_flags.read("vllm", _wheel(tmp_path, files))
    # Only BooleanOptionalAction flags get an inverse; --disable-log-stats is store_true.
    assert flags.names == VLLM_FLAGS | {"--disable-prefix-caching", "--disable-log-requests"}


def test_vllm_optional_valued_bool_str_none_has_no_negation(tmp_path):
    files = dict(VLLM)
    files["vllm/engine/arg_utils.py"] = VLLM["vllm/engine/arg_utils.py"].replace(
        "                if contains_type(type_hints, bool):",
        "                if type_hints == {bool, str, type(None)}:\n"
        "                    pass\n"
        "                elif contains_type(type_hints, bool):",
    )
    files["vllm/entrypoints/openai/cli_args.py"] = VLLM["vllm/entrypoints/openai/cli_args.py"].replace(
        "allow_credentials: bool = False", "allow_credentials: bool | str | None = None"
    )
    flags = engine_flags.read("vllm", _wheel(tmp_path, files))
    assert flags.names == VLLM_FLAGS - {"--no-allow-credentials"}
    assert "rule: bool | str | None is an optional-valued flag, not --x/--no-x" in flags.facts


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        # A computed name cannot be read: the reader stops and names the place.
        (
            'parser.add_argument("--disable-log-stats", action="store_true")',
            'parser.add_argument("--" + "disable-log-stats", action="store_true")',
            r"vllm/engine/arg_utils\.py:\d+: flag name '--' \+ 'disable-log-stats' is not literal",
        ),
        # kwargs from somewhere other than get_kwargs(Cls)[field].
        (
            'group.add_argument("--block-size", **cache_kwargs["block_size"])',
            'group.add_argument("--block-size", **make_kwargs())',
            r"\*\*make_kwargs\(\) is not get_kwargs\(\.\.\.\)\[field\]",
        ),
        # The rule that bools get --no-x is gone: read the release again.
        ("argparse.BooleanOptionalAction\n", "'store_true'\n", r"_compute_kwargs no longer gives bool fields"),
    ],
)
def test_vllm_what_it_cannot_read_stops_it(tmp_path, old, new, error):
    files = dict(VLLM)
    files["vllm/engine/arg_utils.py"] = VLLM["vllm/engine/arg_utils.py"].replace(old, new, 1)
    with pytest.raises(engine_flags.ReadError, match=error):
        engine_flags.read("vllm", _wheel(tmp_path, files))


def test_vllm_a_platform_hook_that_adds_arguments_stops_it(tmp_path):
    files = dict(VLLM)
    files["vllm/platforms/cuda.py"] = """
        class CudaPlatform:
            @classmethod
            def pre_register_and_update(cls, parser=None):
                parser.add_argument("--cuda-only")
    """
    with pytest.raises(engine_flags.ReadError, match=r"vllm/platforms/cuda\.py:\d+: the platform hook registers"):
        engine_flags.read("vllm", _wheel(tmp_path, files))


SGLANG_PREPARE = """
    def prepare_server_args(argv):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        return ServerArgs.from_cli_args(parser.parse_args(argv))
"""


def test_sglang_literal_flags(tmp_path):
    wheel = _wheel(
        tmp_path,
        {
            "sglang/launch_server.py": "",
            "sglang/srt/server_args.py": textwrap.dedent("""
                import argparse

                class ServerArgs:
                    @staticmethod
                    def add_cli_args(parser):
                        parser.add_argument("--model-path", type=str)
                        parser.add_argument("--tensor-parallel-size", "--tp-size", type=int)
                        parser.add_argument("--enable-metrics", action="store_true")
            """)
            + textwrap.dedent(SGLANG_PREPARE),
        },
    )
    flags = engine_flags.read("sglang", wheel)
    assert flags.names == {"--model-path", "--tensor-parallel-size", "--tp-size", "--enable-metrics"}
    assert flags.aliases == [("--tensor-parallel-size", "--tp-size")]
    assert flags.facts == [
        "entry: python3 -m sglang.launch_server (sglang/launch_server.py)",
        "abbreviations: on (argparse allow_abbrev left at its default): a unique prefix stands for the flag",
    ]


def test_sglang_flags_from_annotated_fields(tmp_path):
    # SGLang 0.5-shaped: fields of the namespace classes, with their Arg metadata.
    wheel = _wheel(
        tmp_path,
        {
            "sglang/launch_server.py": "",
            "sglang/srt/arg_groups/arg_utils.py": """
                def _field_to_cli_name(name):
                    return "--" + name.replace("_", "-")

                def add_cli_args_from_dataclass(parser, cls):
                    if inner_type is bool:
                        kwargs = dict(action="store_true")
            """,
            "sglang/srt/arg_groups/fields/parallel.py": """
                import argparse
                from sglang.srt.arg_groups.arg_utils import A, Arg

                class Parallel(msgspec.Struct):
                    _NS_PATH = "parallel"
                    nnodes: A[int, "The number of nodes."] = 1
                    tp_size: A[int, Arg(help="TP.", aliases=["--tensor-parallel-size"])] = 1
                    enable_x: A[bool, Arg(help="x", action=argparse.BooleanOptionalAction)] = True
                    hidden: A[bool, Arg(no_cli=True)] = False
                    internal: int = 0
                    renamed: A[str, Arg(help="r", cli_name="--other-name")] = ""
            """,
            "sglang/srt/server_args.py": textwrap.dedent("""
                import argparse
                from sglang.srt.arg_groups.arg_utils import add_cli_args_from_dataclass
                from sglang.srt.arg_groups.fields.parallel import Parallel

                class ServerArgs:
                    @staticmethod
                    def add_cli_args(parser):
                        add_cli_args_from_dataclass(parser, ServerArgs)
                        parser.add_argument("--config", type=str)

                _INPUT_NAMESPACES = [Parallel]
            """)
            + textwrap.dedent(SGLANG_PREPARE),
        },
    )
    assert engine_flags.read("sglang", wheel).names == {
        "--nnodes",
        "--tp-size",
        "--tensor-parallel-size",
        "--enable-x",
        "--no-enable-x",
        "--other-name",
        "--config",
    }


def test_fixture_text_is_header_facts_then_sorted_flags(tmp_path):
    wheel = _wheel(tmp_path, {"x.py": ""}, name="sglang-9.9-py3-none-any.whl")
    flags = engine_flags.Flags(facts=["entry: e"])
    flags.add(["--b", "--a"], boolean=True)
    lines = engine_flags.fixture_text("sglang", "9.9", wheel, flags).splitlines()
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert lines == [
        f"# sglang 9.9, from sglang-9.9-py3-none-any.whl, sha256 {digest}, read by scripts/engine_flags.py",
        "# entry: e",
        "# alias: --b --a",
        "--a",
        "--b",
        "--no-a",
        "--no-b",
    ]
