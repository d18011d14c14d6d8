"""How the gateway keeps Responses items and records (ids added, what an engine is sent again), reads a record back
(checked, never trusted), pages a list, and rewrites an engine's Response for the client."""

from __future__ import annotations

import orjson
import pytest

from gateway.apis import conversations
from gateway.config import ResponsesConfig
from gateway.errors import GatewayError
from gateway.state.items import client_input, for_engine, output_items, stored_items
from gateway.state.records import RecordCache, decode_record, encode_record
from gateway.state.store import MemoryStore, status_of
from gateway.state.turns import Turn


def test_a_string_input_is_one_user_message_with_an_id():
    (item,) = stored_items("hello")
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "hello"}]


def test_items_get_a_type_and_an_id_and_keep_the_rest():
    items = stored_items([{"role": "assistant", "content": "before"},
                          {"type": "function_call_output", "call_id": "c1", "output": "42"},
                          {"type": "message", "role": "user", "id": "msg_mine", "content": [
                              {"type": "input_text", "text": "x"}]}])
    assert items[0]["type"] == "message" and items[0]["content"] == [{"type": "output_text", "text": "before"}]
    assert items[1]["id"].startswith("fco_") and items[1]["call_id"] == "c1"
    assert items[2]["id"] == "msg_mine"  # a client's own id stays
    assert len({i["id"] for i in items}) == 3


@pytest.mark.parametrize("bad", [5, [1], [{"content": "no type or role"}], {"role": "user"}])
def test_what_is_no_item_is_a_400(bad):
    with pytest.raises(GatewayError) as e:
        stored_items(bad)
    assert e.value.status == 400 and e.value.param == "input"


def test_an_engine_is_sent_items_without_ids_statuses_or_reasoning():
    kept = [{"id": "msg_1", "type": "message", "status": "completed", "role": "user", "content": []},
            {"id": "rs_1", "type": "reasoning", "summary": []},
            {"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert for_engine(kept) == [{"type": "message", "role": "user", "content": []},
                                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert client_input("hi") == [{"role": "user", "content": "hi"}] and client_input(None) == []


def test_output_items_get_ids_where_an_engine_gave_none():
    resp = {"output": [{"type": "message", "content": []}, "junk", {"type": "function_call", "id": "fc_e"}]}
    items = output_items(resp)
    assert [i["id"][:4] for i in items] == ["msg_", "fc_e"] and len(items) == 2


def test_a_record_round_trips_and_a_forged_one_is_refused():
    data = encode_record("completed", "resp_a", ["resp_0"], None, [{"id": "m"}], {"id": "resp_b", "output": []})
    assert status_of(data) == "completed"
    rec = decode_record(data)
    assert rec is not None and rec["chain"] == ["resp_0"] and rec["prev"] == "resp_a"
    for forged in (b"not json", b"[]", b'{"status":"completed"}', b'{"status":1,"input":[],"response":{},"chain":[]}',
                   b'{"status":"completed","input":[],"response":{},"chain":[1],"prev":null}',
                   b'{"status":"completed","input":{},"response":{},"chain":[],"prev":null}'):
        assert decode_record(forged) is None, forged


def test_the_record_cache_is_bounded_least_recent_first_out():
    cache = RecordCache(max_bytes=400)
    blob = encode_record("completed", None, [], None, [], {"id": "r", "pad": "x" * 50})
    for i in range(10):
        cache.put("o", f"r{i}", blob)
    kept = [i for i in range(10) if cache.get("o", f"r{i}") is not None]
    assert kept and kept == list(range(10 - len(kept), 10)) and len(kept) * len(blob) <= 400
    assert cache.get("other", "r9") is None  # by owner too


@pytest.mark.parametrize("query,ids,more", [
    ({}, ["i5", "i4", "i3", "i2", "i1"], False),
    ({"order": "asc", "limit": "2"}, ["i1", "i2"], True),
    ({"order": "asc", "after": "i2", "limit": "2"}, ["i3", "i4"], True),
    ({"order": "desc", "after": "i2"}, ["i1"], False),
])
def test_a_list_page(query, ids, more):
    items = [{"id": f"i{n}"} for n in range(1, 6)]
    page = conversations.page(items, query)
    assert [i["id"] for i in page["data"]] == ids and page["has_more"] is more
    assert page["first_id"] == ids[0] and page["last_id"] == ids[-1]


@pytest.mark.parametrize("query", [{"limit": "0"}, {"limit": "101"}, {"limit": "x"}, {"order": "up"},
                                   {"after": "nope"}])
def test_a_bad_list_query_is_a_400(query):
    with pytest.raises(GatewayError) as e:
        conversations.page([{"id": "i1"}], query)
    assert e.value.status == 400


async def test_a_turn_rewrites_the_engines_response_and_records_it():
    store = MemoryStore(ResponsesConfig())
    body = {"model": "m", "input": "hi", "previous_response_id": "resp_prev"}
    turn = Turn("owner", body, "resp_prev", ["resp_0", "resp_prev"], None, stored_items("hi"), {"model": "m"}, store, None, 1 << 20)
    reply = orjson.dumps({"id": "resp_engine1", "object": "response", "status": "completed", "store": False,
                          "output": [{"type": "message", "role": "assistant", "content": []}]})
    out = orjson.loads(await turn.finish_reply(reply))
    assert out["id"] == turn.id and out["store"] is True and out["previous_response_id"] == "resp_prev"
    assert turn.renamed == (b"resp_engine1", turn.id.encode())
    rec = decode_record(await store.get("resp", "owner", turn.id))
    assert rec is not None and rec["chain"] == ["resp_0", "resp_prev"] and rec["response"]["id"] == turn.id
    assert await store.get("resp", "intruder", turn.id) is None
