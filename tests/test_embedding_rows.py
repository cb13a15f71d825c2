"""Embedding rows read from the weights' file: same values, and the mapping stays unmapped."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model, random_prompts, run_until_done

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.executor.cpu.embedding_rows import FileRows, file_rows
from cbgen.executor.cpu.prepack import file_backed_ranges, page_out

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="file mappings are read from /proc"
)

ROWS, WIDTH, HEADER = 4096, 576, 4104  # a header before the table, as in safetensors


def _mapped_table(tmp_path) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.randn(ROWS, WIDTH)
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x07" * HEADER + table.numpy().tobytes())
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # like safetensors
    mapped = torch.frombuffer(mapping, dtype=torch.float32, offset=HEADER).view(ROWS, WIDTH)
    return table, mapped


def _resident_pages(tensor: torch.Tensor) -> int:
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start // page * 8)
        entries = torch.frombuffer(
            bytearray(pagemap.read(-(-(end - start) // page) * 8)), dtype=torch.int64
        )
    return int((entries < 0).sum())  # bit 63: present


def test_rows_equal_the_table_and_the_mapping_stays_unmapped(tmp_path):
    table, mapped = _mapped_table(tmp_path)
    assert torch.equal(mapped, table)
    page_out(mapped, file_backed_ranges())
    lookup = file_rows(mapped)
    assert isinstance(lookup, FileRows)
    before = _resident_pages(mapped)
    ids = torch.tensor([0, 5, 5, ROWS - 1, 1234, 0, 77])
    assert torch.equal(lookup(ids), F.embedding(ids, table))
    more = torch.randint(0, ROWS, (300,))
    assert torch.equal(lookup(more), F.embedding(more, table))  # loaded and new rows mixed
    assert torch.equal(lookup(ids), F.embedding(ids, table))  # every row loaded already
    assert _resident_pages(mapped) == before  # read with pread, not through the mapping


def test_anonymous_or_written_tables_are_not_read_from_the_file(tmp_path):
    table, mapped = _mapped_table(tmp_path)
    assert file_rows(table) is None  # anonymous memory
    assert file_rows(mapped[:, :64]) is None  # not contiguous
    mapped[10, 3] = 1.5  # a private copy of that page now differs from the file
    assert file_rows(mapped) is None
    _, remapped = _mapped_table(tmp_path / "second")
    assert file_rows(remapped) is not None
    replacement = tmp_path / "second" / "new.bin"
    replacement.write_bytes(b"\0" * 64)
    replacement.replace(tmp_path / "second" / "model.bin")  # the path names another file now
    assert file_rows(remapped) is None


def test_the_bundled_model_embeds_from_its_file_with_the_same_outputs(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "1, 2, 3,")]
    params = SamplingParams(max_new_tokens=8)
    engine = EngineCore(model, EngineConfig())
    try:
        fast = engine.executor.runner.fast_forward
        assert fast is not None and isinstance(fast._embed, FileRows)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(i))
        outputs = {rid: out.token_ids for rid, out in run_until_done(engine).items()}
    finally:
        engine.close()
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert outputs[str(i)] == expected


def test_a_quantized_folder_keeps_its_embedding_in_the_file(tmp_path):
    """Loading a bfloat16 folder with quantization copies what quantization left out of
    the file, except the input embedding: it stays a mapping with its pages dropped, and
    the fast decoder reads its rows from the file, the same tokens as from a copy."""
    make_tiny_model("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    model, _ = cbgen.load_model(str(tmp_path), quantization="int4", tokenizer=False)
    table = model.get_input_embeddings().weight
    assert file_rows(table.detach()) is not None
    assert _resident_pages(table) <= 2  # at most the end pages it shares with its neighbours
    assert file_rows(model.model.norm.weight.detach()) is None  # copied out

    def tokens() -> dict[str, list[int]]:
        engine = EngineCore(model, EngineConfig())
        try:
            fast = engine.executor.runner.fast_forward
            assert fast is not None
            embed = type(fast._embed)
            for i, prompt in enumerate(random_prompts(3, 4, 12, seed=4)):
                engine.add_request(prompt, SamplingParams(max_new_tokens=6), request_id=str(i))
            return {rid: out.token_ids for rid, out in run_until_done(engine).items()}, embed
        finally:
            engine.close()

    from_file, embed = tokens()
    assert embed is FileRows
    with torch.no_grad():
        table.data = table.data.clone()  # the same values in ordinary memory
    from_copy, embed = tokens()
    assert embed is not FileRows and from_copy == from_file
