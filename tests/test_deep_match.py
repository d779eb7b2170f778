"""Deep matches (vllm_fafo.drafting.deep_match) against a
brute-force scan of the texts, and the draft the proposer makes of them."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_fafo.config import FafoConfig, FafoConfigError
from vllm_fafo.drafting import deep_match
from vllm_fafo.drafting.deep_match import MAX_POSITIONS, TenantTexts
from vllm_fafo.drafting.index import DraftIndex, tenant_texts
from vllm_fafo.drafting.pool import Origin, file_in
from vllm_fafo.proposer import longest_match

from .test_native_pool import file_and_draft_one
from .test_tenant_texts import answer_cells, assert_cells_live

KEY_LEN, DEPTH = 3, 24


def scan(own: list[int], own_answer_start: int, answers: list[tuple[list[int], int]],
         room: int) -> tuple[list[int], int]:
    """The reference: every earlier place the own text's last KEY_LEN tokens ended:
    the latest MAX_POSITIONS in all answers (the own one included, where the key's next
    token is in the answer), less the own answer's, then the latest MAX_POSITIONS of the
    own text, each oldest first; the last of the deepest wins; its continuation, and the
    depth."""
    key = own[-KEY_LEN:]
    answer_places = []
    for text, answer_start in [*answers, (own, own_answer_start)]:
        answer_places += [(text, e) for e in range(KEY_LEN - 1, len(text) - 1)
                          if e + 1 >= answer_start and text[e - KEY_LEN + 1 : e + 1] == key]
    places = [(text, e) for text, e in answer_places[-MAX_POSITIONS:] if text is not own]
    return deepest(own, places, room)


def deepest(own: list[int], answer_places: list[tuple[list[int], int]], room: int) -> tuple[list[int], int]:
    """Of ``answer_places`` (each oldest first), then the latest MAX_POSITIONS places of the
    own text's key in it, the last of the deepest: its continuation and the depth."""
    key = own[-KEY_LEN:]
    own_places = [(own, e) for e in range(KEY_LEN - 1, len(own) - 1) if own[e - KEY_LEN + 1 : e + 1] == key]
    best, best_depth = ([], 0), -1
    for text, end in answer_places + own_places[-MAX_POSITIONS:]:
        depth = 0
        while depth < DEPTH and end - depth >= 0 and text[end - depth] == own[len(own) - 1 - depth]:
            depth += 1
        if depth >= best_depth:
            best, best_depth = (text[end + 1 : end + 1 + room], depth), depth
    return best


@pytest.mark.parametrize("vocab", [2, 3, 6])
def test_drafts_equal_a_scan_of_the_own_text_and_the_answers(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    texts = TenantTexts(answer_bytes=1 << 20, max_tenants=4, key_len=KEY_LEN)
    answers = []
    for name in ("old-1", "old-2"):  # finished requests: their answers are kept, their prompts not
        whole = rng.integers(0, vocab, 150).astype(np.int32)
        texts.start(name, None, whole[:30])
        texts.draft(name, whole, 80, room=0)
        texts.draft(name, whole, 150, room=0)
        texts.stop(name)
        answers.append((whole.tolist(), 30))
    text = rng.integers(0, vocab, 400).astype(np.int32)
    text[200:260] = text[40:100]  # a repeat deeper than DEPTH
    texts.start("now", None, text[:50])
    num_tokens, drafted = 50, 0
    while num_tokens < len(text):
        num_tokens = min(len(text), num_tokens + int(rng.integers(1, 5)))  # several tokens per step, as decoding
        found = texts.draft("now", text, num_tokens, room=6)
        expected = scan(text[:num_tokens].tolist(), 50, answers, 6)
        if expected[1] < KEY_LEN:
            expected = ([], 0)
        assert found == expected, num_tokens
        drafted += bool(found[0])
    assert drafted > 50


def test_the_own_texts_chains_draft_as_the_scan_while_texts_move_and_the_table_grows(monkeypatch) -> None:
    """Requests come and go, several at once, in a small vocabulary: every draft from the
    own text (answers off) equals the scan's, while the texts outgrow their segments (their
    chains move with them), the store is compacted and the chains' table, started tiny,
    grows; a stopped request's cells are deleted: the table holds exactly the running
    texts' keys, each where a lookup finds it."""
    monkeypatch.setattr(deep_match, "MIN_HEADS", 8)
    rng = np.random.default_rng(7)
    texts = TenantTexts(answer_bytes=0, max_tenants=4, key_len=KEY_LEN)
    tables, stores = {id(texts.heads)}, {id(texts.store)}
    running: dict[str, tuple[np.ndarray, int]] = {}
    drafted = stopped = 0
    for serial in range(60):
        whole = rng.integers(0, 4, 600).astype(np.int32)
        prompt_len = int(rng.integers(3, 40))
        texts.start(f"r{serial}", None, whole[:prompt_len])
        running[f"r{serial}"] = (whole, prompt_len)
        for name, (whole, num_tokens) in list(running.items()):
            num_tokens = min(len(whole), num_tokens + int(rng.integers(1, 30)))
            found = texts.draft(name, whole, num_tokens, room=5)
            expected = scan(whole[:num_tokens].tolist(), num_tokens, [], 5)
            assert found == (expected if expected[1] >= KEY_LEN else ([], 0)), (name, num_tokens)
            drafted += bool(found[0])
            running[name] = (whole, num_tokens)
            if num_tokens == len(whole) or rng.random() < 0.05:
                texts.stop(name)
                del running[name]
                stopped += 1
        tables.add(id(texts.heads))
        stores.add(id(texts.store))
        keys = {(texts.text_of(name), tuple(whole[e - KEY_LEN + 1 : e + 1])) for name, (whole, num_tokens) in
                running.items() for e in range(KEY_LEN - 1, num_tokens - 1)}
        assert int(texts.heads_used[0]) == int(np.count_nonzero(texts.heads)) == len(keys)
        assert {int(cell) >> 32 for cell in texts.heads[texts.heads != 0]} <= {text for text, _ in keys}
    assert drafted > 500 and stopped > 20 and len(tables) > 3 and len(stores) > 1, (drafted, stopped, tables, stores)
    assert texts.heads_used[0] <= len(texts.heads) // 2


def scan_filed(own: list[int], own_name: str, texts: dict[str, list[int]], filed: list[tuple[str, int]],
               forgotten: set[str], room: int, stop_at_forgotten: bool = True) -> tuple[list[int], int]:
    """The reference where answers are forgotten: of the answers' places filed (in
    ``filed``'s order) where the own text's last KEY_LEN tokens ended, the latest
    MAX_POSITIONS, those filed after the latest of a forgotten answer (``stop_at_forgotten``
    false: every one not forgotten), less the own answer's; then the latest MAX_POSITIONS
    of the own text; the last of the deepest wins (:func:`scan`'s order)."""
    key = own[-KEY_LEN:]
    latest = [(name, e) for name, e in filed if texts[name][e - KEY_LEN + 1 : e + 1] == key][-MAX_POSITIONS:]
    live = []
    for name, e in reversed(latest):
        if name in forgotten:
            if stop_at_forgotten:
                break
            continue
        live.insert(0, (name, e))
    found = deepest(own, [(texts[name], e) for name, e in live if name != own_name], room)
    return found if found[1] >= KEY_LEN else ([], 0)


@pytest.mark.parametrize("vocab", [3, 5])
def test_a_lookup_stops_at_the_latest_place_of_a_forgotten_answer(vocab: int, monkeypatch) -> None:
    """Answers of one tenant, fed interleaved and finishing out of order, are forgotten
    by the byte bound (about two kept) while answers older than theirs stay: every draft
    equals :func:`scan_filed`'s, where a key's places stop at its latest forgotten one;
    drafts that skipping the forgotten places would make differ often enough to tell.
    The texts outgrow their segments, the store (started small) is compacted and the
    chains' table (started tiny) grows, the answers' links and cells moving along."""
    monkeypatch.setattr(deep_match, "MIN_HEADS", 8)
    monkeypatch.setattr(deep_match, "MIN_STORE", 512)
    rng = np.random.default_rng(11)
    length, prompt_len = 90, 20
    texts = TenantTexts(answer_bytes=5 * TenantTexts.answer_charge(length, length - prompt_len) // 2, max_tenants=4,
                        key_len=KEY_LEN)
    whole: dict[str, list[int]] = {}
    fed: dict[str, int] = {}
    filed: list[tuple[str, int]] = []
    finished: list[tuple[str, int]] = []  # kept, the earliest finished first, with its charge
    forgotten: set[str] = set()
    running: list[str] = []
    drafted = differ = 0
    tables, stores = {id(texts.heads)}, {id(texts.store)}
    for serial in range(80):
        name = f"r{serial}"
        whole[name] = rng.integers(0, vocab, length).tolist()
        texts.start(name, None, np.array(whole[name][:prompt_len], dtype=np.int32))
        fed[name] = prompt_len
        running.append(name)
        while len(running) > 2 or (running and rng.random() < 0.3):
            name = running[int(rng.integers(0, len(running)))]
            num_tokens = min(length, fed[name] + int(rng.integers(1, 9)))
            filed += [(name, e) for e in range(fed[name] - 1, num_tokens - 1)]
            fed[name] = num_tokens
            found = texts.draft(name, np.array(whole[name], dtype=np.int32), num_tokens, room=5)
            known = {other: whole[other][: fed[other]] for other in whole}
            assert found == scan_filed(known[name], name, known, filed, forgotten, 5), (name, num_tokens)
            drafted += bool(found[0])
            differ += found != scan_filed(known[name], name, known, filed, forgotten, 5, stop_at_forgotten=False)
            if num_tokens == length or rng.random() < 0.1:
                texts.stop(name)
                running.remove(name)
                finished.append((name, texts.answer_charge(num_tokens, num_tokens - prompt_len)))
                while sum(charge for _, charge in finished) > texts.answer_bytes:
                    forgotten.add(finished.pop(0)[0])
        assert_cells_live(texts)
        tables.add(id(texts.heads))
        stores.add(id(texts.store))
    assert drafted > 100 and differ > 5 and len(forgotten) > 20, (drafted, differ, len(forgotten))
    assert texts.num_kept_answers() == len(finished) + len(running)
    assert len(tables) > 2 and len(stores) > 2, (len(tables), len(stores))


def test_an_evicted_answer_leaves_no_key_behind() -> None:
    for answer_bytes in (1 << 20, 0):  # kept until cleared; forgotten when their request stops
        texts = TenantTexts(answer_bytes=answer_bytes, max_tenants=4, key_len=KEY_LEN)
        whole = np.array([1, 2, 3, *range(10, 40)], dtype=np.int32)
        texts.start("a", None, whole[:3])
        texts.draft("a", whole, len(whole), room=0)
        texts.stop("a")
        assert answer_cells(texts) == (30 if answer_bytes else 0)  # the answer's keys (own text's gone)
        assert int(texts.heads_used[0]) == answer_cells(texts)
        texts.clear()
        assert answer_cells(texts) == 0 and texts.heads_used[0] == 0 and texts.num_kept_answers() == 0


@pytest.mark.parametrize("answer_bytes", [1 << 20, 0])
def test_a_running_request_drafts_from_another_running_requests_answer_when_shared(answer_bytes: int) -> None:
    texts = TenantTexts(answer_bytes=answer_bytes, max_tenants=4, key_len=KEY_LEN)
    texts.start("writer", None, np.array([1, 2]))
    texts.draft("writer", np.array([1, 2, *range(10, 30)]), 22, room=0)
    reader = np.array([7, 8, 10, 11, 12, 13])
    texts.start("reader", None, reader)
    if answer_bytes:
        assert texts.draft("reader", reader, len(reader), room=4) == ([14, 15, 16, 17], 4)
    else:  # no sharing (share_pool false, or no answers kept)
        assert texts.draft("reader", reader, len(reader), room=4) == ([], 0)


def test_running_answers_are_kept_uncharged_and_a_finished_one_over_the_bound_goes() -> None:
    """The byte bound charges finished answers only: running requests share their answers
    whatever their size; one that finishes larger than the bound is forgotten at once."""
    texts = TenantTexts(answer_bytes=1, max_tenants=4, key_len=KEY_LEN)
    texts.start("writer", None, np.array([1, 2]))
    texts.draft("writer", np.array([1, 2, *range(10, 30)]), 22, room=0)
    reader = np.array([7, 8, 10, 11, 12, 13])
    texts.start("reader", None, reader)
    assert texts.num_kept_answers() == 2
    assert texts.draft("reader", reader, len(reader), room=4) == ([14, 15, 16, 17], 4)
    texts.stop("writer")
    assert texts.num_kept_answers() == 1 and texts.charged_bytes(None) == 0
    assert texts.draft("reader", reader, len(reader), room=4) == ([], 0)  # the writer's answer is gone
    texts.stop("reader")
    assert texts.num_kept_answers() == 0 and texts.heads_used[0] == 0 and not texts.heads.any()


def test_kept_answers_hold_their_byte_bound_over_10000_requests() -> None:
    """Requests of two tenants with unrepeated text come and go, several at once: each
    tenant's charged bytes stay within the bound, its latest answers are the ones kept, and
    the arrays stop growing once the answers kept are at the bound."""
    rng = np.random.default_rng(0)
    bound = 1 << 18
    texts = TenantTexts(answer_bytes=bound, max_tenants=4, key_len=KEY_LEN)
    running: list[tuple[str, np.ndarray]] = []
    finished: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    sizes = {}
    for serial in range(10_000):
        name, tenant = f"r{serial}", "ab"[serial % 2]
        whole = rng.integers(0, 50_000, 60).astype(np.int32)
        texts.start(name, tenant, whole[:20])
        texts.draft(name, whole, 40, room=0)
        running.append((name, whole))
        if len(running) == 4:  # the earliest of four running finishes
            done, done_text = running.pop(0)
            texts.draft(done, done_text, len(done_text), room=0)
            texts.stop(done)
            finished["ab"[int(done[1:]) % 2]].append(done_text)
            assert texts.charged_bytes("a") <= bound and texts.charged_bytes("b") <= bound
        if serial + 1 in (2_500, 10_000):
            sizes[serial + 1] = texts.nbytes()
    per_answer = texts.answer_charge(60, 40)
    assert texts.num_kept_answers() - len(running) == 2 * (bound // per_answer)
    assert texts.charged_bytes("a") == (bound // per_answer) * per_answer
    assert sizes[10_000] == sizes[2_500], sizes
    for answer, drafts in ((finished["a"][-1], True), (finished["a"][0], False)):  # the latest kept, the earliest not
        question = np.concatenate([[1], answer[20:30]]).astype(np.int32)
        texts.start("asks", "a", question)
        assert texts.draft("asks", question, len(question), room=4) == ((answer[30:34].tolist(), 10) if drafts else
                                                                         ([], 0))
        texts.stop("asks")


def test_a_short_text_grows_the_batchs_texts_within_a_quarter_of_their_room_and_keeps_every_token() -> None:
    """Where one text of a batch overflows, those within a quarter of their room grow with
    it (to twice their room), the others not; the tokens stay where the texts say."""
    texts = TenantTexts(answer_bytes=1 << 20, max_tenants=4, key_len=KEY_LEN)
    prompts = {name: np.arange(10, dtype=np.int32) + 100 * i for i, name in enumerate(("full", "near", "far"))}
    ids = np.array([texts.start(name, None, prompt) for name, prompt in prompts.items()])
    room = int(texts.capacities[ids[0]])
    assert (texts.capacities[ids] == room).all()
    lengths = np.array([room + 1, room * 3 // 4 + 1, room * 3 // 4])
    texts.make_room(ids, lengths)
    assert texts.capacities[ids].tolist() == [2 * (room + 1), 2 * room, room]
    for text, prompt in zip(ids, prompts.values()):
        start = int(texts.starts[text])
        assert texts.store[start : start + len(prompt)].tolist() == prompt.tolist()


def test_the_proposer_chains_the_pool_where_the_matched_text_ends() -> None:
    index = DraftIndex(FafoConfig(num_speculative_tokens=8))
    repeat = [10, 11, 12, 13, 14, 15]
    text = np.array([1, *repeat, *repeat])  # the end matches the first repeat 6 deep, its continuation ends
    target = index.start("r", None, text)
    file_in(target, repeat[-4:], (20, 21), Origin.LANE)
    draft, origins, depth = file_and_draft_one(index, target, text, len(text), next_anchor=len(text), room=8)
    assert depth == 6
    assert draft == [*repeat, 20, 21]
    assert origins == [Origin.DEEP_MATCH] * 6 + [Origin.LANE] * 2


def test_no_draft_where_the_match_is_no_deeper_than_the_pools_keys() -> None:
    index = DraftIndex(FafoConfig(max_key_len=4))  # deep matches are 5 or more deep
    text = np.array([9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 4])  # "1 2 3 4" again, 4 deep
    target = index.start("r", None, text)  # nothing filed: the pool holds nothing
    assert file_and_draft_one(index, target, text, len(text), next_anchor=len(text), room=16) == ([], [], 0)


def test_config() -> None:
    assert FafoConfig().deep_match
    assert longest_match(FafoConfig()) == DEPTH
    assert longest_match(FafoConfig(deep_match=False)) == FafoConfig.max_key_len
    assert tenant_texts(FafoConfig(deep_match=False)) is None
    with pytest.raises(FafoConfigError, match=r"max_key_len.*=24: deep matches are up to 24 .*allowed: 1 to 23"):
        FafoConfig.from_user_dict({"method": "fafo", "max_key_len": 24})
