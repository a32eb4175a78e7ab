"""llama.cpp's /infill through `specllm serve`, as its editor plugins (llama.vim, llama.vscode) send it:
the prompt laid out as llama.cpp's server lays it out, its answer's fields, the limits editors set
(`n_indent`, `t_max_predict_ms`), and `n_predict: 0`, with which they warm the cache.

The HTTP tests run a tiny model given FIM tokens; those that check where a limit ends the text use
a decoder that writes a script (the tiny model's own text is noise). One test on the default pair
checks Qwen2.5-Coder's repo-level prompt token for token.
"""

from __future__ import annotations

import http.client
import json
import re
import types

import numpy as np
import pytest

from specllm.chat import INFILL_ANSWER, INFILL_BATCH, encode_repo_infill
from specllm.engine.decode import Decoder, fixed_budget, generate_plain
from specllm.engine.drafters import NgramDrafter, common_prefix
from specllm.engine.sampling import SamplingParams
from specllm.errors import UsageError
from specllm.server import worker as worker_module
from specllm.server.app import Service
from specllm.server.endings import IndentCut, StopText, find_filtered_end
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.fakes import FakeBackend, Scripted
from tests.fim_helpers import EXTRA, PREFIX, ROOMY, SUFFIX, fim_engine, fim_model  # noqa: F401 - fixtures
from tests.server_helpers import TINY, WAIT, raw, raw_body, running

FILES = [(chunk["filename"], chunk["text"]) for chunk in EXTRA]
GREEDY_PARAMS = SamplingParams(temperature=0.0)


# -- the prompt ----------------------------------------------------------------------------------


class Vocab:
    """A tokenizer of one token a character (ids from 100), with FIM tokens 1-3 and, unless told
    otherwise, repo-level tokens 4 (repository) and 5 (file separator)."""

    def __init__(self, n_ctx: int = 8192, repo: bool = True, bos: bool = False):
        self.n_ctx, self.repo, self.add_bos = n_ctx, repo, bos
        self.path = types.SimpleNamespace(name="vocab.gguf")

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return ([0] if add_special and self.add_bos else []) + [100 + ord(c) for c in text]

    def fim_tokens(self):
        return 1, 2, 3

    def fim_repo_tokens(self):
        return (4, 5) if self.repo else (None, None)


def chars(text: str) -> list[int]:
    return [100 + ord(c) for c in text]


def test_the_prompt_is_laid_out_as_llama_cpps_server_lays_it_out():
    """Repository, each file after a separator and its name, the file being edited, then the gap:
    FIM prefix, the code before it, the line typed so far, FIM suffix, the code after, FIM middle."""
    prompt = encode_repo_infill(Vocab(), "x = ", "\ny = 2", "1", [("a.py", "A"), ("b.py", "B")])
    assert prompt == (
        [4] + chars("myproject\n") + [5] + chars("a.py\n") + chars("A") + [5] + chars("b.py\n") + chars("B")
        + [5] + chars("filename\n") + [1] + chars("x = ") + chars("1") + [2] + chars("\ny = 2") + [3]
    )  # fmt: skip
    assert encode_repo_infill(Vocab(bos=True), "x", "y")[:2] == [0, 4]  # a BOS the model wants comes first
    # without repo-level tokens, llama.cpp's snippet separator between files, and no names
    assert encode_repo_infill(Vocab(repo=False), "x", "y", extra=[("a.py", "A")]) == (
        chars("\n\n--- snippet ---\n\n") + chars("A") + [1] + chars("x") + [2] + chars("y") + [3]
    )
    with pytest.raises(UsageError, match="no fill-in-the-middle tokens"):
        encode_repo_infill(types.SimpleNamespace(fim_tokens=lambda: None, path=Vocab().path), "x", "y")


def test_the_prompt_is_cut_as_llama_cpps_server_cuts_it():
    """The code before the gap keeps its last three quarters of a 2048-token batch, the code after
    its first quarter less the typed line and two FIM tokens; the files keep their latest tokens,
    as many as the context holds beside a batch and room for the answer, whatever the request asks
    for (a warm-up and the completion after it read the same files' tokens)."""
    prefix, suffix, typed = "p" * 2000 + "P", "S" + "s" * 900, "tt"
    prompt = encode_repo_infill(Vocab(n_ctx=4096), prefix, suffix, typed, [("old.py", "o" * 3000 + "O")])
    head = prompt[: prompt.index(1)]
    assert len(head) == 4096 - INFILL_BATCH - 2 * INFILL_ANSWER  # the files' latest tokens, then the edited file's name
    assert head[-10:] == [5] + chars("filename\n") and head[-11] == 100 + ord("O") and head[0] == 100 + ord("o")
    gap = prompt[prompt.index(1) + 1 : prompt.index(2)]
    assert gap == chars(prefix[-1536:] + typed)
    after = prompt[prompt.index(2) + 1 : -1]
    assert after == chars(suffix[: INFILL_BATCH // 4 - 2 - len(typed)])
    # the longest gap leaves room for the answer: at least 510 tokens
    assert len(encode_repo_infill(Vocab(n_ctx=4096), prefix * 2, suffix, "", [("old.py", "o" * 3000)])) <= 4096 - 510
    # a context too small for the batch and the answer: no files at all
    assert 4 not in encode_repo_infill(Vocab(n_ctx=2048), "x", "y", extra=[("a.py", "A")])


@pytest.mark.parametrize("n_ctx", [2048, 1024, 700])
def test_in_a_small_context_the_gap_shrinks_to_leave_the_answer_its_room(n_ctx):
    """`-c 2048` or less: a full batch beside the answer's room would not fit, so the batch is what the
    room leaves, cut in the same quarters (llama.cpp's default batch would overflow every long gap)."""
    prefix, suffix = "p" * 3000, "s" * 3000
    prompt = encode_repo_infill(Vocab(n_ctx=n_ctx), prefix, suffix, "t", [("a.py", "A" * 500)])
    batch = n_ctx - 2 * INFILL_ANSWER
    assert len(prompt) <= n_ctx - 2 * INFILL_ANSWER + 1 and 4 not in prompt
    assert prompt.count(100 + ord("p")) == 3 * (batch // 4) and prompt.count(100 + ord("s")) == batch // 4 - 3


# -- where editors' limits end the text ----------------------------------------------------------

INDENTED = "a + b\n    c = 1\n\n  \n    d = 2\n  e\nf\n"
INDENT_CASES = {  # (n_indent, text) -> what is kept
    "a line indented less ends it, its indentation kept": (4, INDENTED, "a + b\n    c = 1\n\n  \n    d = 2\n  "),
    "the first line is never checked": (4, "x\n    y", "x\n    y"),
    "a line with nothing before its end is no code": (4, "x\n\n\n    y\nz", "x\n\n\n    y\n"),
    "tabs count as one each": (2, "x\n\t\ty\n\tz", "x\n\t\ty\n\t"),
    "carriage returns are no code": (2, "x\r\n\r\n  y\r\nz", "x\r\n\r\n  y\r\n"),
    "off": (0, INDENTED, INDENTED),
}


@pytest.mark.parametrize("n_indent, text, kept", INDENT_CASES.values(), ids=INDENT_CASES.keys())
def test_n_indent_ends_the_text_before_the_first_line_indented_less(n_indent, text, kept):
    for cut in range(len(text) + 1):  # every split into two pieces, and one character a piece
        for pieces in ([text[:cut], text[cut:]], list(text)):
            indent = IndentCut(n_indent)
            out = "".join(indent.push(piece) for piece in pieces) + indent.flush()
            assert out == kept, (cut, pieces)
            assert indent.stopped == (kept != text)


class _Lines(FakeBackend):
    """The fake target with a new line, a space and letters for its tokens: its greedy text runs in
    lines of code-like indentation, and repeats (the n-gram cache drafts it long)."""

    def token_bytes(self, token: int) -> bytes:
        return b"\n" if token == 0 else b" " if token == 1 else chr(ord("a") + token).encode()


def test_the_filters_find_where_a_draft_would_end_the_text_and_stay_as_they_were():
    text, indent = StopText(["END"]), IndentCut(4)
    assert indent.push(text.push("x = 1\n    y")) == "x = 1\n    y"
    assert find_filtered_end(text, indent, [" = 2", "E", "ND", "z"]) == 2  # "END" completed
    assert find_filtered_end(text, indent, ["\n", "  ", "z"]) == 2  # a line indented 2 begun
    assert find_filtered_end(text, indent, ["\n\n", "    z", "EN"]) is None
    assert (text.held, text.stopped, indent.held, indent.stopped) == ("", False, "", False)


def test_a_draft_is_not_verified_past_the_line_that_ends_an_editors_completion():
    """The same completion asked again with `n_indent` (the n-gram cache drafts the remembered answer
    16 tokens at a time): the draft is cut at the token that begins the line ending the block, as
    a stop string's is, so the batch holds nothing the editor would not get; the text is plain
    decoding's, cut there."""
    prompt = [2, 3, 4, 0, 1, 1, 5, 6, 0, 1, 1, 7, 0, 3]
    plain = "".join(_Lines(seed=10).token_bytes(t).decode() for t in generate_plain(_Lines(seed=10), prompt, 60, GREEDY_PARAMS, None))
    indent = IndentCut(1)
    kept = indent.push(plain) + indent.flush()
    assert indent.stopped and len(kept) == 7  # "deehhf\n", then a line that is not indented
    decoder = Decoder(_Lines(seed=10), NgramDrafter(2, 4), fixed_budget(16))
    serving, posted = worker_module.Worker(lambda: decoder), []
    for n_indent in (0, 1):  # the worker's own loop, in this thread
        serving._serve(worker_module.Job(prompt, 60, GREEDY_PARAMS, lambda kind, payload: posted.append((kind, payload)), n_indent=n_indent))
    kind, result = posted[-1]
    assert kind == "done" and result.text == kept and result.cut
    assert result.stats.drafted == len(kept) + 1  # to the token that begins the short line, not 16
    assert len(decoder.history) - len(prompt) == len(kept) + 2  # and the target's token after it


# -- over HTTP -----------------------------------------------------------------------------------


def infill(url: str, body: dict) -> dict:
    status, answer = raw(url, "POST", "/infill", body)
    assert status == 200, answer
    return answer


def test_infill_answers_plain_decodings_text_in_llama_cpps_fields(fim_engine):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "a", "n_predict": 24, "temperature": 0}
    prompt = encode_repo_infill(fim_engine.target, PREFIX, SUFFIX, "a", FILES)
    chunk = fim_engine.target.tokenize(EXTRA[0]["text"])
    assert any(prompt[i : i + len(chunk)] == chunk for i in range(len(prompt))), "the other file is in the prompt"
    events = fim_engine.decoder("off").generate(prompt, 24, SamplingParams(temperature=0.0), np.random.default_rng(0))
    plain = list(events)[-1]
    with running(Service(fim_engine, "tiny-fim")) as url:
        answer = infill(url, body)
        streamed = stream(url, {**body, "stream": True})
    assert answer["content"] == plain.text and answer["stop"] is True
    assert answer["stop_type"] == ("eos" if plain.finish_reason == "stop" else "limit")
    assert answer["tokens_evaluated"] == len(prompt) and answer["tokens_predicted"] == len(plain.tokens)
    assert answer["tokens_cached"] == answer["tokens_evaluated"] + answer["tokens_predicted"]
    timings = answer["timings"]
    assert timings["predicted_n"] == answer["tokens_predicted"] and timings["predicted_ms"] > 0
    assert answer["usage"]["speculation"]["strategy"] == "ngram"
    *pieces, last = streamed
    assert "".join(p["content"] for p in pieces) == answer["content"] and not any(p["stop"] for p in pieces)
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == answer["stop_type"]


def stream(url: str, body: dict) -> list[dict]:
    """The events of a streamed /infill, read to the end of the response (llama.cpp's stream has no [DONE])."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    try:
        connection.request("POST", "/infill", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
        text = response.read().decode()
    finally:
        connection.close()
    assert "[DONE]" not in text
    return [json.loads(line[len("data: ") :]) for line in text.split("\n\n") if line]


def test_n_predict_0_reads_the_prompt_and_the_next_request_reuses_it(fim_engine):
    """llama.vim and llama.vscode send the code around the cursor with `n_predict: 0` as the user
    moves: the next completion, which asks for hundreds of tokens, finds it in the KV cache, the
    other files too where they are more than the context has room for."""
    files = [{"filename": f"mod{i}.py", "text": CODE_FILE.replace("Stack", f"Stack{i}")} for i in range(12)]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": files}
    target = fim_engine.target
    room = ROOMY.n_ctx - INFILL_BATCH - 2 * INFILL_ANSWER
    assert sum(len(target.tokenize(f["text"])) for f in files) > room  # cut to fit
    with running(Service(fim_engine, "tiny-fim")) as url:
        warm = infill(url, {**body, "n_predict": 0})
        answer = infill(url, {**body, "prompt": "a", "n_predict": 256, "temperature": 0})
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop_type"] == "limit"
    assert warm["timings"]["prompt_n"] == warm["tokens_evaluated"] > 0
    pairs = [(f["filename"], f["text"]) for f in files]
    shared = common_prefix(encode_repo_infill(target, PREFIX, SUFFIX, "", pairs), encode_repo_infill(target, PREFIX, SUFFIX, "a", pairs))
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == shared > room  # the files and the code before the gap
    assert answer["timings"]["prompt_n"] == answer["tokens_evaluated"] - cached


BAD = {  # body -> the field named in the error
    "no input_prefix": ({"input_suffix": ""}, "input_prefix"),
    "no input_suffix": ({"input_prefix": ""}, "input_suffix"),
    "a prefix that is no text": ({"input_prefix": 3, "input_suffix": ""}, "input_prefix"),
    "input_extra no array": ({"input_prefix": "", "input_suffix": "", "input_extra": "x"}, "input_extra"),
    "a chunk without text": ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a.py"}]}, "input_extra[0]"),
    "a chunk's name no text": ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "filename": 1}]}, "input_extra[0].filename"),
    "n_predict below -1": ({"input_prefix": "", "input_suffix": "", "n_predict": -2}, "n_predict"),
    "t_max_predict_ms past a float's range": ({"input_prefix": "", "input_suffix": "", "t_max_predict_ms": 10**400}, "t_max_predict_ms"),
    "input_extra an object": ({"input_prefix": "", "input_suffix": "", "input_extra": {}}, "input_extra"),
    "response_fields no strings": ({"input_prefix": "", "input_suffix": "", "response_fields": [1]}, "response_fields"),
    "a prompt that is no text": ({"input_prefix": "", "input_suffix": "", "prompt": ["a"]}, "prompt"),
    "a body that is no object": ([1, 2], None),
}


def test_bad_infill_requests_get_one_error_each_and_the_server_keeps_serving(fim_engine, tiny_pair):
    with running(Service(fim_engine, "tiny-fim")) as url:
        for name, (body, param) in BAD.items():
            status, answer = raw(url, "POST", "/infill", body)
            assert status == 400 and answer["error"]["param"] == param, (name, answer)
        assert infill(url, {"input_prefix": "x", "input_suffix": "", "n_predict": 2})["stop"] is True
    engine = Engine(ModelPaths(tiny_pair[0]), SpecConfig("ngram"), TINY, TINY)  # a model without FIM tokens
    try:
        with running(Service(engine, "tiny")) as url:
            status, answer = raw(url, "POST", "/infill", {"input_prefix": "x", "input_suffix": ""})
    finally:
        engine.close()
    assert status == 400 and "no fill-in-the-middle tokens" in answer["error"]["message"]


SCRIPT = ["b", "\n", "    c", " = 1", "\n", "\n", "    d", "\n", "e", " = 2", "\n"]
CODE_FILE = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n" * 6


def test_n_indent_ends_an_answer_at_the_block_end(fim_engine):
    with running(Service(fim_engine, "tiny-fim", make_decoder=lambda: Scripted(SCRIPT))) as url:
        answer = infill(url, {"input_prefix": "def f():\n    return ", "input_suffix": "", "n_indent": 4})
        whole = infill(url, {"input_prefix": "def f():\n    return ", "input_suffix": ""})
        streamed = stream(url, {"input_prefix": "x", "input_suffix": "", "n_indent": 4, "stream": True})
        fields = infill(url, {"input_prefix": "def f():\n    return ", "input_suffix": "",
                              "response_fields": ["content", "timings/prompt_n", "tokens_cached", "timings/no"]})  # fmt: skip
        # as llama.cpp's: limits of 0 or less are off, an n_predict beyond the context runs to its end
        lenient = infill(url, {"input_prefix": "x", "input_suffix": "", "n_indent": -1, "t_max_predict_ms": -1, "n_predict": 10**6})
    with running(Service(fim_engine, "tiny-fim", make_decoder=lambda: Scripted(["b", "\ne = 2", "\n"]))) as url:
        both = infill(url, {"input_prefix": "x", "input_suffix": "", "n_indent": 4, "stop": ["= 2"]})
    assert both["content"] == "b\n" and both["stop_type"] == "limit"  # the short line came before the stop string
    assert set(fields) == {"content", "timings/prompt_n", "tokens_cached"} and fields["content"] == "".join(SCRIPT)
    assert fields["timings/prompt_n"] == whole["timings"]["prompt_n"] and fields["tokens_cached"] == whole["tokens_cached"]
    assert lenient["content"] == "".join(SCRIPT)
    assert answer["content"] == "b\n    c = 1\n\n    d\n" and answer["stop_type"] == "limit"
    assert whole["content"] == "".join(SCRIPT) and whole["stop_type"] == "eos"
    assert "".join(e["content"] for e in streamed) == answer["content"] and streamed[-1]["stop_type"] == "limit"


# llama.vim's request as it sends it (its ring of other files' chunks carries a time), and the fields it reads
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms", "timings/prompt_per_second",
              "timings/predicted_n", "timings/predicted_ms", "timings/predicted_per_token_ms", "timings/predicted_per_second",
              "truncated", "tokens_cached"]  # fmt: skip
VIM_REQUEST = {"id_slot": 0, "input_prefix": "def f():\n    return ", "input_suffix": "\n", "prompt": "", "n_predict": 128,
               "input_extra": [{"text": "x = 1\n", "time": 1733000000.5, "filename": "a.py"}], "stop": [], "n_indent": 4,
               "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
               "t_max_prompt_ms": 500, "t_max_predict_ms": 1000 * WAIT, "response_fields": VIM_FIELDS}  # fmt: skip


def test_llama_vims_request_gets_an_answer_that_llama_vim_reads(fim_engine):
    """llama.vim drops an answer unless its raw text passes `'^\\s*{'` and `'\\v"content"\\s*:"'` (no
    space after the colon, as llama.cpp writes JSON): with `"content": "` no completion ever showed."""
    with running(Service(fim_engine, "tiny-fim", make_decoder=lambda: Scripted(SCRIPT))) as url:
        status, text = raw_body(url, "/infill", VIM_REQUEST)
        _, streamed = raw_body(url, "/infill", {**VIM_REQUEST, "stream": True, "response_fields": None})
    assert status == 200 and re.match(r"\s*\{", text) and re.search(r'"content"\s*:"', text), text
    answer = json.loads(text)
    assert sorted(answer) == sorted(VIM_FIELDS) and answer["content"] == "b\n    c = 1\n\n    d\n"
    events = [line for line in streamed.split("\n\n") if line]
    assert events and all(re.match(r'data: \{"content":"', line) for line in events), streamed


def test_a_model_name_on_infill_is_not_checked_and_an_empty_one_is_none_anywhere(fim_engine):
    """llama.vim sends `"model": ""` (its `model_fim` unset), llama.vscode the name it starts
    llama-server with; llama.cpp's /infill reads neither. The OpenAI routes still refuse another
    model's name, not an empty one."""
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with running(Service(fim_engine, "tiny-fim", make_decoder=lambda: Scripted(SCRIPT))) as url:
        named = [raw_body(url, "/infill", {**VIM_REQUEST, "model": name})[0] for name in ("", "ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF")]
        chats = [raw_body(url, "/v1/chat/completions", {**chat_body, "model": name})[0] for name in ("", " ", "gpt-4o")]
    assert named == [200, 200] and chats == [200, 200, 404]


def test_t_max_predict_ms_ends_an_answer_past_its_first_new_line(fim_engine, monkeypatch):
    """llama.cpp's rule: once a new line has come, an answer that has taken longer than the limit
    ends; before one, the line being typed is finished whatever it takes."""
    now = [0.0]

    def clock() -> float:  # each reading a second later
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(perf_counter=clock))
    one_line = ["a"] * 8
    with running(Service(fim_engine, "tiny-fim", make_decoder=lambda: Scripted(SCRIPT))) as url:
        answer = infill(url, {"input_prefix": "x", "input_suffix": "", "t_max_predict_ms": 2500})
    with running(Service(fim_engine, "tiny-fim", make_decoder=lambda: Scripted(one_line))) as url:
        long_line = infill(url, {"input_prefix": "x", "input_suffix": "", "t_max_predict_ms": 2500})
    assert answer["content"].startswith("b\n") and len(answer["content"]) < len("".join(SCRIPT))
    assert answer["stop_type"] == "limit"
    assert long_line["content"] == "a" * 8 and long_line["stop_type"] == "eos"


# -- the default pair ----------------------------------------------------------------------------


@pytest.mark.real
def test_qwen_reads_its_repo_level_prompt_and_fills_the_gap_as_plain_decoding_does(qwen_engine):
    """Qwen2.5-Coder's own tokens (found by llama.cpp in its vocabulary) in the layout its model card
    gives for repository-level completion; the middle is plain decoding's text on those tokens."""
    target = qwen_engine.target

    def special(text: str) -> list[int]:
        tokens = target.tokenize(text, parse_special=True)
        assert len(tokens) == 1, text
        return tokens

    roomy = types.SimpleNamespace(**{name: getattr(target, name) for name in ("tokenize", "fim_tokens", "fim_repo_tokens", "add_bos", "path")},
                                  n_ctx=4096)  # fmt: skip
    assert encode_repo_infill(roomy, PREFIX, SUFFIX, "", FILES) == (
        special("<|repo_name|>") + target.tokenize("myproject\n") + special("<|file_sep|>") + target.tokenize("stack.py\n")
        + target.tokenize(EXTRA[0]["text"]) + special("<|file_sep|>") + target.tokenize("filename\n")
        + special("<|fim_prefix|>") + target.tokenize(PREFIX) + special("<|fim_suffix|>") + target.tokenize(SUFFIX) + special("<|fim_middle|>")
    )  # fmt: skip
    prompt = encode_repo_infill(target, PREFIX, SUFFIX, "", FILES)  # 1,024 tokens of context: no room for the files
    plain = list(qwen_engine.decoder("off").generate(prompt, 16, SamplingParams(temperature=0.0), np.random.default_rng(0)))[-1]
    with running(Service(qwen_engine, "qwen")) as url:
        answer = infill(url, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "n_predict": 16, "temperature": 0})
    assert answer["tokens_evaluated"] == len(prompt)
    assert answer["content"] == plain.text and "a - b" in answer["content"] and answer["stop_type"] == "eos"
