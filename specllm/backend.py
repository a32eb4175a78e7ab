"""The llama.cpp binding: the only module that imports llama_cpp.

A `LlamaBackend` holds one model and one context with a single sequence. `evaluate`
appends tokens to the KV cache and returns logits only for the rows asked for (per-token
logits flags), `rewind` drops the KV cache after a position, `snapshot`/`restore` save and bring back
a KV cache (the calibration's timings at two depths, side by side). `kv_edits` counts the changes to
the KV cache, so that a decoder sees when another user of the model (a second decoder of one engine,
the calibration, a pass an exception cut short) changed it behind its back. Everything above this module
talks to the small `Backend` protocol (`specllm.engine.protocol`), so tests can swap in a fake model.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from specllm.chat import ChatTemplate
from specllm.engine.protocol import Backend  # noqa: F401 - the protocol this module implements
from specllm.errors import SpecllmError, UsageError, one_line


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int = 4096
    n_threads: int | None = None  # None: every core up to 8, half of them above
    n_gpu_layers: int = -1  # -1: all layers when the build can offload, else 0
    n_batch: int = 512
    exact: bool = False  # batch-invariant kernels: verified rows equal single tokens' bit for bit (CPU only; small batches)
    flash_attn: str = "auto"  # llama.cpp's flash attention: "auto" (its choice: on where it can), "on" or "off"


FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
MAX_CTX = 2**31 - 1  # a context's positions are llama.cpp's int32 llama_pos (0: the size the model was trained on)


def supports_gpu_offload() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def gpu_layers(options: LoadOptions) -> int:
    """The layers a model loaded with `options` offloads: all of them (-1) only where the build can."""
    if options.exact:
        return 0  # llama.cpp's GPU kernels differ by batch size too, and have no switches
    if options.n_gpu_layers >= 0:
        return options.n_gpu_layers
    return 999 if supports_gpu_offload() else 0


def system_info() -> str:
    """llama.cpp's build and CPU features, and which of its CPU weight buffers specllm leaves out
    (a cost curve is measured for one choice: it is part of the curve's cache key)."""
    _init_llama()
    info = _llama_system_info()
    return info if _buffers_left_out is None else f"{info} specllm: no {_buffers_left_out} buffers |"


def _llama_system_info() -> str:
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()


# llama.cpp's AMX matrix kernels crash the process (a segmentation fault) at the first batch of two
# or more tokens, a prompt's prefill, on some Xeons with AMX: on a 2-core Xeon VM with AMX_INT8 every
# run did (llama-cpp-python 0.3.36, Q4_K_M and Q4_1 models; llama.cpp issue 20824, unfixed). A
# build has them where it was compiled on such a CPU. llama.cpp has no switch for them alone (its
# `use_extra_bufts` also drops the repacked layouts, which made one token 1.3x faster there), so
# the AMX buffer type is taken out of the list of extra buffer types its model loader reads.
_buffers_left_out: str | None = None  # "AMX", "extra" (every extra buffer type, where AMX could not be taken out alone), None
_log_callback = None


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C and SIGTERM while llama.cpp loads a model, and deliver them when it returns.

    Python runs a signal's handler at its next bytecode, which during a load is llama.cpp's log
    callback (Python, called from C), and ctypes prints and drops an exception raised there: the
    command went on as if no key had been pressed. Only the main thread can set handlers; a load
    elsewhere (a server's worker) is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in held:
            signal.raise_signal(signum)  # to the handler the command had: its exit code, its message


def _init_llama() -> None:
    """Once per process: silence llama.cpp's log (it would mix with our stderr), init the backend,
    and keep its AMX kernels out of every model loaded from here on."""
    global _log_callback, _buffers_left_out
    if _log_callback is None:
        import llama_cpp

        _log_callback = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        if "AMX_INT8 = 1" in _llama_system_info():
            _buffers_left_out = "AMX" if _drop_extra_buffer_type(b"AMX") else "extra"


def _ggml():
    """llama.cpp's ggml library as ctypes sees it (loaded already, with llama_cpp), or None."""
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml.so", "ggml.dll", "libggml.dylib"):
        try:
            lib = ctypes.CDLL(str(folder / name))
        except OSError:
            continue
        try:
            for function, restype, argtypes in (
                ("ggml_backend_dev_by_type", ctypes.c_void_p, [ctypes.c_int]),
                ("ggml_backend_dev_backend_reg", ctypes.c_void_p, [ctypes.c_void_p]),
                ("ggml_backend_reg_get_proc_address", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]),
                ("ggml_backend_buft_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ):
                getattr(lib, function).restype, getattr(lib, function).argtypes = restype, argtypes
        except AttributeError:  # an older ggml without the backend registry
            return None
        return lib
    return None


def buffers_left_out() -> str | None:
    """Which of llama.cpp's CPU weight buffers specllm keeps models out of: "AMX", "extra" (all of its
    extra buffer types), or None."""
    _init_llama()
    return _buffers_left_out


def extra_buffer_types() -> tuple[ctypes.Array | None, list[bytes]]:
    """The NULL-ended array of CPU extra buffer types llama.cpp's model loader reads, and their names
    (None and [] where this build does not say)."""
    lib = _ggml()
    cpu = lib.ggml_backend_dev_by_type(0) if lib is not None else None  # GGML_BACKEND_DEVICE_TYPE_CPU
    address = lib.ggml_backend_reg_get_proc_address(lib.ggml_backend_dev_backend_reg(cpu), b"ggml_backend_dev_get_extra_bufts") if cpu else None
    if not address:
        return None, []
    types = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(cpu)
    names = []
    while types[len(names)]:
        names.append(lib.ggml_backend_buft_name(types[len(names)]))
    return types, names


def _drop_extra_buffer_type(name: bytes) -> bool:
    """Take one buffer type out of that array (the rest move up; llama.cpp keeps its own list for
    computing, where a type with no buffers does nothing). False where the array cannot be read."""
    types, names = extra_buffer_types()
    if types is None:
        return False
    kept = [types[i] for i, each in enumerate(names) if each != name]
    for i in range(len(names)):
        types[i] = kept[i] if i < len(kept) else None
    return True


# Three of llama.cpp's CPU kernels compute a row of a batch differently from the same token alone (read
# in the source llama-cpp-python 0.3.36 builds, and measured), so a batched verification's logits differ
# from plain decoding's by up to 0.8 and a near tie can flip: the repacked weight layouts' kernel for
# 4 rows or more, the tiled K-quant kernel for 8 or more, and flash attention's split of the cache
# among threads for one token once 256 are cached (only where K and V share a type). `exact` caches V
# in BF16 beside K's F16 (attention then takes flash attention's per-row kernel at every size) and
# verifies no more tokens a pass than the largest batch whose rows equal single tokens', found at load
# (`exact_batch`): 3 where the weights are repacked, 7 where not. Prompts, read alike by plain and
# speculative decoding, keep every kernel; so does plain decoding (one token a pass).
EXACT_MAX_BATCH = 7  # below the tiled kernel's smallest batch (llama.cpp's ggml_tiled_min_batch: 8)
EXACT_CHECK_TEXT = " one two three four five six seven eight nine ten"


def exact_batch(model: "Backend", largest: int = EXACT_MAX_BATCH) -> int:
    """The largest batch (up to `largest`) such that in it and in every smaller one a token's logits
    are, bit for bit, those of the same token alone: batches of 2, 3, ... are compared with one token
    until one differs. Where even 2 does, exact output would mean plain decoding: refused. Costs a
    pass and a batch of each size tried; leaves the KV cache empty."""
    tokens = model.tokenize(EXACT_CHECK_TEXT)[:largest]
    model.rewind(0)
    alone = np.array(model.evaluate(tokens[:1], [0])[0])
    size, gap = 1, 0.0
    while size < len(tokens):
        model.rewind(0)
        in_batch = np.array(model.evaluate(tokens[: size + 1], [0])[0])
        if not np.array_equal(alone, in_batch):
            gap = float(np.max(np.abs(alone - in_batch)))
            break
        size += 1
    model.rewind(0)
    if size < 2:
        raise SpecllmError(
            f"{Path(getattr(model, 'path', 'the target')).name}: exact kernels are not available here: llama.cpp computes a token "
            f"in a batch of 2 differently from the same token alone (logits up to {gap:.3g} apart), so output could part "
            "from plain decoding's at a near tie"
        )
    return size


class LlamaBackend:
    """One GGUF model loaded through llama.cpp, with one sequence in its KV cache."""

    def __init__(self, path: str | Path, options: LoadOptions = LoadOptions()):
        with _signals_held():
            self._load(path, options)

    def _load(self, path: str | Path, options: LoadOptions) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.path = Path(path)
        if not 0 <= options.n_ctx <= MAX_CTX:  # llama.cpp reads an unsigned 32-bit size: 2**32 + 256 would be 256, silently
            bound = f"at most {MAX_CTX} tokens (llama.cpp's positions are 32-bit)" if options.n_ctx > 0 else "0 or more (0: the length the model was trained on)"
            raise UsageError(f"--ctx-size must be {bound}, got {options.n_ctx}")
        _init_llama()
        model_params = llama_cpp.llama_model_default_params()
        self.n_gpu_layers = model_params.n_gpu_layers = gpu_layers(options)
        if _buffers_left_out == "extra" and hasattr(model_params, "use_extra_bufts"):
            model_params.use_extra_bufts = False
        self._model = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), model_params)  # the path's own bytes: a name that is no UTF-8 (Linux) loads too
        if not self._model:
            raise SpecllmError(f"{self.path}: llama.cpp could not load it (unsupported architecture or damaged file)")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self._model))

        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = options.n_ctx
        ctx_params.n_batch = options.n_batch
        ctx_params.n_ubatch = options.n_batch
        ctx_params.n_seq_max = 1
        threads = options.n_threads or _default_threads()
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        # as asked (auto: llama.cpp's choice); exact kernels need flash attention's kernel, one per query row
        self.flash_attn = "on" if options.exact else options.flash_attn
        ctx_params.flash_attn_type = FLASH_ATTN[self.flash_attn]
        if options.exact:
            ctx_params.type_v = 30  # GGML_TYPE_BF16: K and V of different types keep one token's attention unsplit
        self.n_threads = threads
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            self.close()
            raise SpecllmError(f"{self.path}: llama.cpp could not create a context of {options.n_ctx} tokens")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        # llama.cpp pads n_ctx up but cuts n_batch down to the n_ctx asked for; a bigger batch aborts the process.
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.n_past = 0
        self.kv_edits = 0  # changes to the KV cache: evaluations, rewinds that dropped something, restores
        self._piece_cache: dict[int, bytes] = {}
        self._chat_template: ChatTemplate | None | bool = False  # compiled at first use (None: it cannot be)
        self.exact_batch: int | None = None  # with exact kernels, the largest verification that keeps them
        if options.exact:
            try:
                self.exact_batch = exact_batch(self)
            except SpecllmError:
                self.close()
                raise

    @property
    def exact(self) -> bool:
        """Loaded with exact kernels (`LoadOptions.exact`)."""
        return self.exact_batch is not None

    # -- tokens -------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8", "replace")
        capacity = len(data) + 16
        buf = (self._lib.llama_token * capacity)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (self._lib.llama_token * capacity)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (control tokens render as nothing)."""
        piece = self._piece_cache.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[:n]
            self._piece_cache[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        """The vocabulary entry as stored (special tokens included), for vocabulary checks."""
        return self._lib.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    @property
    def add_bos(self) -> bool:
        return bool(self._lib.llama_vocab_get_add_bos(self._vocab))

    def fim_tokens(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle) as llama.cpp finds them in the
        vocabulary, or None where the model has none."""
        lib, vocab = self._lib, self._vocab
        tokens = (lib.llama_vocab_fim_pre(vocab), lib.llama_vocab_fim_suf(vocab), lib.llama_vocab_fim_mid(vocab))
        return None if min(tokens) < 0 else tuple(int(t) for t in tokens)

    def fim_repo_tokens(self) -> tuple[int | None, int | None]:
        """The repository-name and file-separator tokens of repo-level fill-in-the-middle
        (Qwen2.5-Coder's <|repo_name|> and <|file_sep|>), each None where the model has none."""
        lib, vocab = self._lib, self._vocab
        tokens = (lib.llama_vocab_fim_rep(vocab), lib.llama_vocab_fim_sep(vocab))
        return tuple(int(t) if t >= 0 else None for t in tokens)

    def apply_chat_template(self, messages: list[dict], add_assistant: bool = True, tools: list[dict] | None = None,
                            variables: dict | None = None) -> str:  # fmt: skip
        """Render messages with the model's own template: its Jinja text as Transformers renders it
        (so a default system prompt the template has, Qwen's or SmolLM2's, is there when no system
        message is), else, where that cannot render, llama.cpp's built-in formatter for its family.
        `tools` (OpenAI's function definitions) only where the Jinja template takes them; `variables`
        are the template's own switches (`enable_thinking`), which the built-in formatter has none of."""
        template = self.chat_template()
        if tools:
            if template is None or not template.takes_tools:
                raise SpecllmError(f"the chat template of {self.path.name} does not take tools")
            try:
                return template.render(messages, add_assistant, tools, variables)
            except Exception as exc:  # noqa: BLE001 - the template refused these messages
                raise SpecllmError(f"the chat template of {self.path.name} cannot render these messages: {exc}") from None
        try:
            if template is not None:
                return template.render(messages, add_assistant, variables=variables)
        except Exception:  # noqa: BLE001 - a template this renderer cannot run on these messages
            pass
        return self._render_built_in(self._template_text(), messages, add_assistant)

    def chat_template(self) -> ChatTemplate | None:
        """The model's Jinja chat template, compiled once, or None where it cannot be compiled."""
        if self._chat_template is False:
            try:
                eos = self.token_text(int(self._lib.llama_vocab_eos(self._vocab)))
                bos = int(self._lib.llama_vocab_bos(self._vocab))  # -1: the model has none
                self._chat_template = ChatTemplate(self._template_text().decode("utf-8", "replace"), eos, self.token_text(bos) if bos >= 0 else "")
            except Exception:  # noqa: BLE001 - no renderer here, or a template it cannot compile
                self._chat_template = None
        return self._chat_template

    def _template_text(self) -> bytes:
        tmpl = self._lib.llama_model_chat_template(self._model, None)
        if not tmpl:
            raise SpecllmError(f"{self.path.name} has no chat template; use --raw")
        return tmpl

    def _render_built_in(self, tmpl: bytes, messages: list[dict[str, str]], add_assistant: bool) -> str:
        msgs = (self._lib.llama_chat_message * len(messages))()
        keep = []  # the encoded strings must outlive the call
        for slot, message in zip(msgs, messages):
            role, content = message["role"].encode(), message["content"].encode()
            keep += [role, content]
            slot.role, slot.content = role, content
        size = sum(len(k) for k in keep) * 2 + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_chat_apply_template(tmpl, msgs, len(messages), add_assistant, buf, size)
            if n < 0:
                raise SpecllmError(f"llama.cpp does not support the chat template of {self.path.name}; use --raw")
            if n <= size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n + 1
        raise SpecllmError("chat template rendering failed")  # pragma: no cover

    # -- evaluation ---------------------------------------------------------------------

    def evaluate(self, tokens: Sequence[int], rows: Sequence[int], copy: bool = True) -> np.ndarray:
        """Append `tokens` to the KV cache; return the logits of `rows` (increasing indices into `tokens`).

        Long inputs are split into batches of n_batch; only the requested rows are computed.
        `copy=False`: for a caller that reads the rows at once, they may be llama.cpp's own buffer
        (read-only), valid until this model's next evaluate: copying 151,936 logits costs about
        55 µs a row on a 2-core EPYC, 1.8 ms for a verification of 32, where a GPU's whole pass
        of 32 tokens takes a few milliseconds.
        """
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextFull(self.n_past, len(tokens), self.n_ctx)
        if rows and not 0 <= min(rows) <= max(rows) < len(tokens):
            raise ValueError(f"rows {list(rows)} are not among the {len(tokens)} tokens evaluated")
        wanted = set(rows)
        if not copy and 0 < len(tokens) <= self.n_batch:
            self._decode(tokens, [i in wanted for i in range(len(tokens))])
            return self._logits(len(wanted))
        out = np.empty((len(wanted), self.n_vocab), dtype=np.float32)
        filled = 0
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            flags = [start + i in wanted for i in range(len(chunk))]
            self._decode(chunk, flags)
            n_out = sum(flags)
            if n_out:
                out[filled : filled + n_out] = self._logits(n_out)
                filled += n_out
        return out

    def _logits(self, n_out: int) -> np.ndarray:
        """The last batch's `n_out` rows of logits, in llama.cpp's buffer."""
        if not n_out:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        rows = np.ctypeslib.as_array(self._lib.llama_get_logits(self._ctx), shape=(n_out, self.n_vocab))
        rows.flags.writeable = False
        return rows

    def _decode(self, chunk: Sequence[int], flags: Sequence[bool]) -> None:
        decode = self._lib.llama_decode  # first: after `close` this is what says so (the batch is freed)
        batch = self._batch
        self.kv_edits += 1
        for i, (token, want) in enumerate(zip(chunk, flags)):
            batch.token[i] = token
            batch.pos[i] = self.n_past + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = want
        batch.n_tokens = len(chunk)
        try:
            status = decode(self._ctx, batch)
        except BaseException:
            # A Ctrl-C lands in the pass and is raised as it returns, the batch in the KV cache: count what
            # llama.cpp holds, or rewind(0) keeps it and the next evaluation fails (status -1).
            self.n_past = int(self._lib.llama_memory_seq_pos_max(self._memory, 0)) + 1
            raise
        if status != 0:
            raise SpecllmError(f"llama.cpp failed to evaluate a batch of {len(chunk)} tokens (status {status})")
        self.n_past += len(chunk)

    def rewind(self, n_past: int) -> None:
        """Drop every KV cache entry at position >= n_past."""
        if n_past < self.n_past:
            self._lib.llama_memory_seq_rm(self._memory, 0, n_past, -1)
            self.n_past = n_past
            self.kv_edits += 1

    def snapshot(self) -> "KvSnapshot":
        """A copy of the KV cache as it is now, for `restore`: cheaper than evaluating its tokens again."""
        size = self._lib.llama_state_seq_get_size(self._ctx, 0)
        data = (ctypes.c_uint8 * size)()
        used = self._lib.llama_state_seq_get_data(self._ctx, data, size, 0)
        return KvSnapshot(data, used, self.n_past)

    def restore(self, snapshot: "KvSnapshot") -> None:
        """Make the KV cache hold exactly what it held at `snapshot`."""
        self.kv_edits += 1
        if not self._lib.llama_state_seq_set_data(self._ctx, snapshot.data, snapshot.size, 0):
            raise SpecllmError("llama.cpp could not restore a saved KV cache")
        self.n_past = snapshot.n_past

    def close(self) -> None:
        """Free the model and its context. Any later use raises `SpecllmError` (llama.cpp would read
        freed memory: a crash, or tokens from garbage)."""
        lib = self._lib
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None
        self._lib = _Closed(self.path)

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass


class _Closed:
    """What a closed `LlamaBackend` calls llama.cpp through: every call says the model is closed."""

    def __init__(self, path: Path):
        self.path = path

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copying, pickling: not a call into llama.cpp
            raise AttributeError(name)
        raise SpecllmError(f"{self.path.name} is closed (Engine.close or LlamaBackend.close freed it): load it again to use it")


class DeferredBackend:
    """A model loaded at its first evaluation rather than at start: `--spec auto` consults the draft
    model only where it pays, and on most CPUs it never does (on a 2-core EPYC, loading the default
    pair's 0.5B and its context took 0.9-1.3 s and 600 MB of memory, for nothing).
    Before the load it holds no KV cache: `rewind` has nothing to drop. Anything else is the
    loaded model's (`__getattr__` loads it).

    The load comes minutes into a run or a chat, and may fail there (the file removed, replaced or
    cut short since the start, memory taken by then): `error` keeps why, and later loads raise it
    again without trying (the drafter goes on without the model; the front ends say so once)."""

    def __init__(self, path: str | Path, options: LoadOptions, load: Callable[[Path, LoadOptions], Backend] = LlamaBackend):
        self.model: Backend | None = None
        self.path, self.options, self._load = Path(path), options, load
        self.n_gpu_layers = gpu_layers(options)
        self.closed = False
        self.error: SpecllmError | None = None  # why the load failed (then it is not tried again)
        self._identity = _file_identity(self.path)  # the file as the start checked it (its vocabulary)

    @property
    def loaded(self) -> bool:
        return self.model is not None

    @property
    def n_past(self) -> int:
        return self.model.n_past if self.model is not None else 0

    @property
    def kv_edits(self) -> int | None:
        return getattr(self.model, "kv_edits", None) if self.model is not None else 0

    def load(self) -> Backend:
        if self.model is None:
            if self.closed:  # its engine was closed before it was ever used: loading now would leak it
                raise SpecllmError(f"{self.path.name} is closed (Engine.close freed it): load it again to use it")
            if self.error is not None:
                raise self.error
            try:
                self._check_unchanged()
                self.model = self._load(self.path, self.options)
            except (SpecllmError, OSError, MemoryError) as exc:
                self.error = exc if isinstance(exc, SpecllmError) else SpecllmError(f"{self.path}: {'out of memory' if isinstance(exc, MemoryError) else one_line(exc)}")
                raise self.error from None
        return self.model

    def _check_unchanged(self) -> None:
        """The start checked this file's vocabulary against the target's: another file in its place
        (a download finished meanwhile, a copy cut short) was never checked."""
        if self._identity is None:  # not a file here (a test's loader): nothing to compare
            return
        now = _file_identity(self.path)
        if now is None:
            raise SpecllmError(f"{self.path}: the file is gone (removed since this process started)")
        if now != self._identity:
            raise SpecllmError(f"{self.path}: the file changed since this process started (its size or time)")

    def rewind(self, n_past: int) -> None:
        if self.model is not None:
            self.model.rewind(n_past)

    def close(self) -> None:
        self.closed = True
        if self.model is not None:
            self.model.close()

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copying, pickling, an attribute not set yet: no reason to load
            raise AttributeError(name)
        return getattr(self.load(), name)


def _file_identity(path: Path) -> tuple[int, int] | None:
    """A file's size and modification time (None where it cannot be read)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


@dataclass(frozen=True)
class KvSnapshot:
    data: ctypes.Array  # llama.cpp's serialised sequence state
    size: int
    n_past: int


class ContextFull(SpecllmError):
    def __init__(self, n_past: int, n_new: int, n_ctx: int):
        super().__init__(f"context full: {n_past} tokens held + {n_new} new > context size {n_ctx}")
        self.n_past, self.n_new, self.n_ctx = n_past, n_new, n_ctx


def _default_threads() -> int:
    count = os.cpu_count() or 1
    return count if count <= 8 else count // 2
