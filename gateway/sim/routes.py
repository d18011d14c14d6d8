"""Each engine's own non-inference routes: health, models, load probes, props/slots and metrics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from gateway.sim import metrics
from gateway.sim.scheduler import SimRequest
from gateway.sim.state import SIM, SimState
from gateway.sim.tokens import IM_END, IM_START

SGLANG_HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT default


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _err(st: SimState, status: int, message: str, type_: str | None = None) -> web.Response:
    return _json(st.fmt.error(status, message, type_), status)


async def get_metrics(request: web.Request) -> web.Response:
    st = request.app[SIM]
    now = asyncio.get_running_loop().time()
    text = metrics.render(st.engine_name, st.model, st.sched, st.tel, now)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"Process-Start-Time-Unix": str(int(st.started_unix))}
                        if st.engine_name == "llamacpp" else None)


async def sim_state(request: web.Request) -> web.Response:
    """Simulator internals (not an engine route): queue, batch, KV and real-time loop health."""
    st = request.app[SIM]
    now = asyncio.get_running_loop().time()
    return _json({
        "engine": st.engine_name, "profile": st.profile.name, "ready": st.ready.is_set(),
        "running": len(st.sched.running), "waiting": st.sched.waiting_count(now),
        "kv_used_tokens": st.sched.kv_used_tokens(), "steps": st.sched.counters.steps,
        "late_steps": st.tel.late_steps, "rebases": st.tel.rebases,
        "itl_sum_s": st.tel.itl.sum, "itl_count": st.tel.itl.count,
        "ttft_sum_s": st.tel.ttft.sum, "ttft_count": st.tel.ttft.count,
    })


def _card(st: SimState, name: str, owner: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(st.started_unix), "owned_by": owner,
            "root": st.model, "parent": None, "max_model_len": st.profile.max_model_len}


# -- vLLM -------------------------------------------------------------------------------------
async def vllm_health(request: web.Request) -> web.Response:
    st = request.app[SIM]
    # 503 with an empty body is what an EngineDeadError turns into.
    return web.Response(status=503 if st.faults.spec.unhealthy else 200)


async def vllm_models(request: web.Request) -> web.Response:
    st = request.app[SIM]
    data = []
    for name in st.opts.model_names:
        card = _card(st, name, "vllm")
        card["permission"] = [{
            "id": f"modelperm-{name}", "object": "model_permission", "created": card["created"],
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}]
        data.append(card)
    return _json({"object": "list", "data": data})


async def vllm_load(request: web.Request) -> web.Response:
    return _json({"server_load": request.app[SIM].inflight})


async def vllm_version(request: web.Request) -> web.Response:
    return _json({"version": "0.32.0+sim"})


# -- SGLang -----------------------------------------------------------------------------------
async def sglang_health(request: web.Request) -> web.Response:
    st = request.app[SIM]
    if not st.ready.is_set() or st.faults.spec.unhealthy:
        return web.Response(status=503)
    if st.sched.running:
        return web.Response(status=200)  # a busy engine's own output satisfies the probe
    # An idle engine runs a one-token generation before it says it is healthy.
    now = asyncio.get_running_loop().time()
    probe = SimRequest(prompt=[0], max_new=1, arrival=now, ready_at=now, internal=True)
    ticket = st.engine.submit(probe)
    try:
        async with asyncio.timeout(SGLANG_HEALTH_TIMEOUT_S):
            while not ticket.done:
                await ticket.wait()
    except TimeoutError:
        return web.Response(status=503)
    finally:
        if not ticket.done:
            st.engine.abort(ticket)
    return web.Response(status=200)


async def sglang_ping(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def sglang_root(request: web.Request) -> web.Response:
    return web.Response(text="SGLang is running")


async def sglang_models(request: web.Request) -> web.Response:
    st = request.app[SIM]
    return _json({"object": "list", "data": [_card(st, n, "sglang") for n in st.opts.model_names]})


async def sglang_model(request: web.Request) -> web.Response:
    st = request.app[SIM]
    name = request.match_info["model"]
    if name not in st.opts.model_names:
        return _json({"error": {"message": f"The model '{name}' does not exist",
                                "type": "invalid_request_error", "param": "model",
                                "code": "model_not_found"}}, 404)
    return _json(_card(st, name, "sglang"))


def _sglang_load(st: SimState, now: float) -> dict[str, Any]:
    p, s = st.profile, st.sched
    used = s.kv_used_tokens()
    pending = sum(r.prompt_len for r in s.waiting if r.ready_at <= now)
    return {
        "dp_rank": 0, "timestamp": time.time(), "num_running_reqs": len(s.running),
        "num_waiting_reqs": s.waiting_count(now), "num_used_tokens": used,
        "num_total_tokens": used + pending, "max_total_num_tokens": p.kv_tokens,
        "token_usage": used / p.kv_tokens, "gen_throughput": st.tel.gen_throughput,
        "cache_hit_rate": s.counters.last_hit_rate,
        "utilization": len(s.running) / p.max_running, "max_running_requests": p.max_running,
    }


async def sglang_loads(request: web.Request) -> web.Response:
    st = request.app[SIM]
    load = _sglang_load(st, asyncio.get_running_loop().time())
    return _json({"timestamp": load["timestamp"], "version": "0.5.20+sim", "dp_rank_count": 1,
                  "loads": [load]})


async def sglang_get_load(request: web.Request) -> web.Response:
    st = request.app[SIM]
    now = asyncio.get_running_loop().time()
    load = _sglang_load(st, now)
    return _json([{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                   "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_used_tokens"],
                   "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"],
                   "ts_tic": time.perf_counter()}])


async def sglang_model_info(request: web.Request) -> web.Response:
    st = request.app[SIM]
    return _json({"model_path": st.model, "tokenizer_path": st.model, "is_generation": True,
                   "preferred_sampling_params": None, "weight_version": "default",
                   "has_image_understanding": False, "has_audio_understanding": False,
                   "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]})


async def sglang_flush_cache(request: web.Request) -> web.Response:
    st = request.app[SIM]
    if st.sched.running or st.sched.waiting:
        return web.Response(status=400, text="Cache not flushed: requests are running or waiting.")
    assert st.sched.cache is not None
    st.sched.cache.clear()
    return web.Response(text="Cache flushed.")


# -- llama.cpp --------------------------------------------------------------------------------
def llama_loading(st: SimState) -> web.Response:
    return _err(st, 503, "Loading model", "unavailable_error")


async def llama_health(request: web.Request) -> web.Response:
    st = request.app[SIM]
    if st.faults.spec.unhealthy:
        return llama_loading(st)
    return _json({"status": "ok"})


def _llama_meta(st: SimState) -> dict[str, Any] | None:
    if not st.ready.is_set():
        return None  # not known until the model is loaded
    return {"vocab_type": 2, "n_vocab": 151_936, "n_ctx_train": st.profile.max_model_len,
            "n_embd": 2048, "n_params": st.profile.n_params, "size": st.profile.n_params // 2}


async def llama_models(request: web.Request) -> web.Response:
    st = request.app[SIM]
    meta = _llama_meta(st)
    name = st.model
    return _json({
        "models": [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "",
                    "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                    "parameters": "", "details": {"parent_model": "", "format": "gguf",
                                                  "family": "", "families": [""],
                                                  "parameter_size": "", "quantization_level": ""}}],
        "object": "list",
        "data": [{"id": name, "object": "model", "created": int(st.started_unix),
                  "owned_by": "llamacpp", "meta": meta}],
    })


def _slot_params(st: SimState) -> dict[str, Any]:
    return {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "seed": st.opts.seed, "stream": True, "cache_prompt": True}


async def llama_props(request: web.Request) -> web.Response:
    st = request.app[SIM]
    n_ctx = st.profile.slot_ctx()
    return _json({
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": n_ctx,
                                        "speculative": False, "is_processing": False,
                                        "params": _slot_params(st)},
        "total_slots": st.profile.max_running, "model_alias": st.model,
        "model_path": f"/models/{st.model}.gguf", "modalities": {"vision": False, "audio": False},
        "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
        "bos_token": IM_START, "eos_token": IM_END, "build_info": "b11434-sim",
        "is_sleeping": False,
    })


async def llama_slots(request: web.Request) -> web.Response:
    st = request.app[SIM]
    owners = st.sched.slot_owner
    if request.query.get("fail_on_no_slot") not in (None, "", "0", "false") and all(owners):
        return _err(st, 503, "no slot available", "unavailable_error")
    n_ctx = st.profile.slot_ctx()
    slots = []
    for i, owner in enumerate(owners):
        busy = owner is not None
        n_remain = owner.max_new - owner.generated if owner is not None else -1
        n_decoded = owner.generated if owner is not None else 0
        slots.append({
            "id": i, "id_task": id(owner) % 1_000_000 if busy else -1, "n_ctx": n_ctx,
            "speculative": False, "is_processing": busy, "params": _slot_params(st),
            "next_token": [{"has_next_token": busy, "has_new_line": False,
                            "n_remain": n_remain, "n_decoded": n_decoded, "stopping_word": ""}],
        })
    return _json(slots)


def engine_routes(engine: str) -> list[web.RouteDef]:
    """The routes of one flavour, besides the inference routes."""
    if engine == "vllm":
        return [web.get("/health", vllm_health), web.get("/ping", vllm_health),
                web.post("/ping", vllm_health), web.get("/version", vllm_version),
                web.get("/load", vllm_load), web.get("/v1/models", vllm_models),
                web.get("/metrics", get_metrics)]
    if engine == "sglang":
        return [web.get("/health", sglang_health), web.get("/health_generate", sglang_health),
                web.get("/ping", sglang_ping), web.get("/", sglang_root),
                web.get("/v1/models", sglang_models), web.get("/v1/models/{model}", sglang_model),
                web.get("/v1/loads", sglang_loads), web.get("/get_load", sglang_get_load),
                web.get("/model_info", sglang_model_info),
                web.get("/get_model_info", sglang_model_info),
                web.post("/flush_cache", sglang_flush_cache),
                web.get("/flush_cache", sglang_flush_cache), web.get("/metrics", get_metrics)]
    return [web.get("/health", llama_health), web.get("/v1/health", llama_health),
            web.get("/props", llama_props), web.get("/slots", llama_slots),
            web.get("/models", llama_models), web.get("/v1/models", llama_models),
            web.get("/metrics", get_metrics)]
