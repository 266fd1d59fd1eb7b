"""The OpenAI API of a real `keepwarm serve` process, through the official `openai` client."""

from __future__ import annotations

import itertools
import json

import httpx
import openai
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_health_answers_while_loading_and_ready_and_inference_wait(served):
    health_status, _ = served.early["health"]
    ready_status, ready_body = served.early["ready"]
    chat_status, chat_body = served.early["chat"]
    assert health_status == 200
    assert ready_status == 503 and json.loads(ready_body)["error"]["code"] == "model_not_ready"
    assert chat_status == 503 and chat_body["error"]["type"] == "service_unavailable_error"


def test_ready_long_poll_answers_once_loaded_and_refuses_a_bad_wait(served):
    """Sent while /ready still said 503, each long poll (wait=1000: capped, not refused) held its answer
    for the whole cap or until the weights were in, and the last answered 200; a wait that is not a
    number is refused by name."""
    from keepwarm_api.probes import READY_WAIT_MAX_S

    *waiting, (last_status, _) = served.early["ready_long_poll"]
    assert last_status == 200
    assert all(status == 503 and seconds >= READY_WAIT_MAX_S - 1 for status, seconds in waiting), waiting
    bad = httpx.get(served.proc.url + "/ready", params={"wait": "soon"}, timeout=10)
    assert bad.status_code in (400, 422) and "wait" in bad.text


def test_weights_fell_back_to_disk_and_load_metrics_are_exposed(served):
    metrics = served.proc.metrics()
    assert metrics['keepwarm_weight_load_seconds{source="disk"}'] >= 0
    assert metrics["keepwarm_process_start_to_ready_seconds"] > 0
    assert "cache miss" in served.proc.log_text()  # the hung daemon was tried, then disk


def test_startup_phases_are_logged_and_exported_and_add_up_to_start_to_ready(served):
    import inspect

    from keepwarm_runtime.cache.client import attach
    from keepwarm_runtime.engine.startup import PHASES

    metrics = served.proc.metrics()
    phases = {p: metrics[f'keepwarm_startup_phase_seconds{{phase="{p}"}}'] for p in PHASES}
    assert all(seconds >= 0 for seconds in phases.values())
    # The hung daemon held the attach for its timeout. The attach ran in the background from process
    # start (engine/prefetch.py), so the wait is in the attach's own time, not necessarily in a phase:
    # the weights phase is only what the main line still waited for it.
    timeout_s = inspect.signature(attach).parameters["timeout_s"].default
    assert metrics['keepwarm_weight_load_seconds{source="disk"}'] >= timeout_s
    assert phases["imports"] > 0 and phases["warmup"] > 0 and phases["weights"] > 0
    # Contiguous phases from process start: together they are start to ready (two clocks, one span).
    assert sum(phases.values()) == pytest.approx(metrics["keepwarm_process_start_to_ready_seconds"], abs=0.5)
    log = served.proc.log_text()
    assert "startup phases: imports " in log and "weights " in log
    assert "s (disk; attached in the background in " in log


def test_the_server_runs_uvicorn_on_uvloop_and_httptools(served):
    """Both are runtime dependencies; without them uvicorn falls back to asyncio and h11, and a stream's
    chunks cost the event loop more. The log names what it runs."""
    assert "event loop uvloop, HTTP httptools)" in served.proc.log_text()


def test_threads_follow_the_cpus_this_process_may_use(served):
    from keepwarm_runtime.engine.threads import choose_threads

    expected = choose_threads()  # the child inherits this process's affinity, cgroup and environment
    log = served.proc.log_text()
    assert (
        f"intra-op threads: {expected.threads} ({expected.reason}; torch reports {expected.threads})" in log
    )
    assert f"; {expected.threads} intra-op threads" in log  # as the engine thread sees it


def test_threads_flag_is_honoured_by_the_engine_thread(served_secure):
    log = served_secure.proc.log_text()  # started with KEEPWARM_THREADS=1 (conftest)
    assert "intra-op threads: 1 (--threads/KEEPWARM_THREADS; torch reports 1)" in log
    assert "; 1 intra-op threads" in log


def test_version_and_models(served, client):
    assert served.proc.get_json("/version")["model"] == "tiny"
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_completion_is_seeded_and_counts_usage(client, tiny_llama):
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, seed=7)
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, seed=7)
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert again.choices[0].message.content == choice.message.content
    assert first.usage.completion_tokens <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    # One BOS: the template starts with it and rendering must not add a second.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert expected.count(tokenizer.bos_token) == 1
    assert first.usage.prompt_tokens == len(tokenizer(expected, add_special_tokens=False)["input_ids"])


def test_streaming_chat_matches_the_non_streaming_answer(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=16, seed=3, temperature=0.8)
    whole = client.chat.completions.create(**kwargs).choices[0]
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.message.content
    assert finishes == [whole.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_a_stream_of_several_choices_with_logprobs_matches_the_non_streaming_answer(client):
    """Each choice's chunks (put together from the engine's deltas) carry its text and one logprob
    entry a token, as the same request unstreamed returns them, and its usage counts every token."""
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, n=3, seed=11, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    for choice in whole.choices:
        mine = [c for chunk in chunks for c in chunk.choices if c.index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        streamed = [(e.token, e.logprob) for c in mine if c.logprobs for e in c.logprobs.content]
        assert streamed == [(e.token, e.logprob) for e in choice.logprobs.content]
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_and_logprobs_in_chat(client):
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, n=3, seed=11, logprobs=True, top_logprobs=3
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    for choice in response.choices:
        content = choice.logprobs.content
        assert len(content) == len(choice.message.content and content)
        for entry in content:
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert entry.logprob <= tops[0] + 1e-5


def test_completions_with_several_prompts_n_and_logprobs(client):
    response = client.completions.create(
        model="tiny", prompt=["def f(", "import"], max_tokens=4, n=2, logprobs=2, seed=7
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) <= 4
        joined = "".join(choice.logprobs.tokens)
        # A token that is part of a character reads as U+FFFD alone, and a text ending inside a
        # character holds its bytes back: only tokens of whole characters join into the text.
        assert joined == choice.text or "\ufffd" in joined
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)


def test_completion_stream_and_echo(client):
    stream = client.completions.create(model="tiny", prompt="class", max_tokens=6, seed=5, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    whole = client.completions.create(model="tiny", prompt="class", max_tokens=6, seed=5, echo=True)
    assert whole.choices[0].text == "class" + text


def test_stop_string_cuts_the_output(client):
    greedy = dict(model="tiny", prompt="return", max_tokens=12, temperature=0)
    full = client.completions.create(**greedy).choices[0].text
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), full
    cut = client.completions.create(**greedy, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_a_streamed_stop_string_is_never_half_sent(client):
    """A stop string whose first character ends one chunk's text and whose last starts the next one's:
    the stream holds the end of its text back while a stop string may be starting there, so what it
    sends is the text the same request gets without streaming, in chat and completions alike."""
    greedy = dict(model="tiny", prompt="return", max_tokens=16, temperature=0)
    stop = _across_chunks([c.choices[0].text for c in client.completions.create(**greedy, stream=True)])
    cut = client.completions.create(**greedy, stop=[stop]).choices[0].text
    streamed = client.completions.create(**greedy, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut

    chat = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    stop = _across_chunks(
        [c.choices[0].delta.content for c in client.chat.completions.create(**chat, stream=True)]
    )
    cut = client.chat.completions.create(**chat, stop=[stop]).choices[0].message.content
    streamed = client.chat.completions.create(**chat, stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def _across_chunks(pieces: list[str | None]) -> str:
    """Two characters that first occur across a chunk boundary of a stream's text."""
    whole = "".join(p or "" for p in pieces)
    ends = list(itertools.accumulate(len(p) for p in pieces if p))[:-1]
    return next(whole[end - 1 : end + 1] for end in ends if whole.find(whole[end - 1 : end + 1]) == end - 1)


def test_openai_error_shapes(served, client):
    max_model_len = served.max_model_len
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad_param:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=9)
    assert bad_param.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt="x " * (max_model_len + 10), max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="tiny", prompt="x", max_tokens=max_model_len * 2)
    assert too_many.value.body["code"] == "context_length_exceeded"
    malformed = httpx.post(
        served.proc.url + "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400
    assert set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    assert malformed.json()["error"]["code"] == "invalid_json"
    unknown_route = httpx.get(served.proc.url + "/v1/nothing")
    assert unknown_route.status_code == 404 and "error" in unknown_route.json()
    metrics = served.proc.metrics()
    assert metrics['keepwarm_http_requests_total{endpoint="/v1/chat/completions",status="404"}'] >= 1
    assert metrics['keepwarm_http_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 2


def test_request_metrics_are_recorded(served, client):
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, seed=1)
    metrics = served.proc.metrics()
    for name in (
        "keepwarm_time_to_first_token_seconds_count",
        "keepwarm_time_per_output_token_seconds_count",
        "keepwarm_e2e_request_latency_seconds_count",
        "keepwarm_prompt_tokens_total",
        "keepwarm_generation_tokens_total",
        'keepwarm_http_requests_total{endpoint="/v1/chat/completions",status="200"}',
    ):
        assert metrics[name] > 0, name
    for gauge in (
        "keepwarm_num_requests_running",
        "keepwarm_num_requests_waiting",
        "keepwarm_kv_cache_usage_ratio",
    ):
        assert gauge in metrics
