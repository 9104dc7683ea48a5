"""The plan page (shardfn/show/plan_page.py, plan.to_html, python -m shardfn.show): rendered for a two-matmul function
and a transformers Llama, opened in a real headless browser (Debian's chromium; .ci/run installs it), and what a
person sees there checked: the folded module tree with its count, the mesh grid of rank cells with each piece,
the collectives and their phase filter; the plan's JSON round trip and the errors for files that are not plans."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import shardfn as sf
from shardfn.config import Precision
from shardfn.show.plan_page import _bytes, _seconds
from shardfn.show.__main__ import main as show_main
from shardfn.strategy_search._dtensor_adapter import local_pieces
from shardfn.strategy_search._summary import placements_text
from shardfn.strategy_search.plan import PLAN_FORMAT, Plan, parse_placement
from tests.transformers_models import MODELS, batch, megatron

REPO = Path(__file__).resolve().parents[2]


# -- the browser and what it shows ----------------------------------------------------------------------------------

def _chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    assert found, "the plan page tests need Debian's chromium: apt-get install chromium (.ci/run installs it)"
    return found


def _browse(page: Path, tmp_path: Path, fragment: str = "") -> _Node:
    """The page's DOM after its scripts ran, in headless chromium (nothing fetched: every net switch off)."""
    out = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium'}", "--dump-dom", page.as_uri() + fragment],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "</html>" in out.stdout, out.stderr[-2000:]
    return _parse(out.stdout)


class _Node:
    def __init__(self, tag: str, attrs: dict, parent: _Node | None):
        self.tag, self.attrs, self.parent, self.children, self.parts = tag, attrs, parent, [], []

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)

    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def all(self, tag: str | None = None, cls: str | None = None, **attrs) -> list[_Node]:
        found = []
        for c in self.children:
            if (tag is None or c.tag == tag) and (cls is None or cls in c.classes()) and \
                    all(c.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items()):
                found.append(c)
            found += c.all(tag, cls, **attrs)
        return found

    def one(self, tag: str | None = None, cls: str | None = None, **attrs) -> _Node:
        found = self.all(tag, cls, **attrs)
        assert len(found) == 1, (tag, cls, attrs, len(found))
        return found[0]

    def visible(self) -> bool:
        node = self
        while node is not None:
            if "hidden" in node.attrs:
                return False
            node = node.parent
        return True


class _Tree(HTMLParser):
    _VOID = {"meta", "input", "br", "img", "link", "hr", "col", "source", "wbr"}

    def __init__(self):
        super().__init__()
        self.root = self.at = _Node("#document", {}, None)

    def handle_starttag(self, tag, attrs):
        node = _Node(tag, dict(attrs), self.at)
        self.at.children.append(node)
        self.at.parts.append(node)
        if tag not in self._VOID:
            self.at = node

    def handle_endtag(self, tag):
        node = self.at
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.at = node.parent

    def handle_data(self, data):
        self.at.parts.append(data)


def _parse(text: str) -> _Node:
    tree = _Tree()
    tree.feed(text)
    return tree.root


def _link(dom: _Node, text: str) -> str:
    """The tensor id a person clicks on where the page names ``text``."""
    ids = {a.attrs["data-t"] for a in dom.all("a", "t") if a.text == text}
    assert len(ids) == 1, (text, ids)
    return ids.pop()


def _cells(dom: _Node) -> list[tuple[str, str, str, list[str]]]:
    """The layout panel's rank cells: (rank, shape text, offset text, classes)."""
    return [(c.one("b").text, c.one("div", "shape").text, c.one("div", "offset").text, c.classes())
            for c in dom.one("div", id="layout").all("div", "rank")]


def _summaries(dom: _Node) -> dict[str, _Node]:
    return {_own_label(d): d for d in dom.all("details", "module")}


def _own_label(details: _Node) -> str:
    summary = next(c for c in details.children if c.tag == "summary")
    return next(c for c in summary.children if "mname" in c.classes()).text


# -- (a) two matmuls on a 2 x 2 mesh ----------------------------------------------------------------------------------

def _two_matmuls() -> Plan:
    def f(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    # w1's 3 columns over 4 ranks: pieces of 1, 1, 1 and 0 columns; relu's (6, 3) cut 2 + 1 by 3 + 3 rows
    x, w1, w2 = torch.randn(6, 8), torch.randn(8, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    return sf.explain(f, x, w1, w2, world_size=4, in_strategy=((2, 1), (1, 4), (4, 1)))


def test_a_function_plan_page_in_a_browser(tmp_path):
    plan = _two_matmuls()
    assert plan.mesh.shape == (2, 2)
    page = Path(plan.to_html(str(tmp_path / "plan.html")))
    text = page.read_text()
    # one file, nothing to fetch when it is viewed
    assert "<script src" not in text and "<link" not in text and "http://" not in text and "https://" not in text
    raw = _parse(text)
    w1, relu = _link(raw, "input 1"), _link(raw, "relu")

    dom = _browse(page, tmp_path, f"#t={w1}&phase=backward")
    panel = dom.one("div", id="layout")
    assert panel.attrs["data-shown"] == w1
    assert panel.one(id="layout-name").text == "input 1"
    assert panel.one(id="layout-placements").text == "(S(1),S(1))"
    assert panel.one(id="layout-origin").text == "layout from: given by the caller (in_strategy)"
    # a 2 x 2 grid of ranks; the last rank's piece is empty, and says so
    assert panel.one("div", "mesh").attrs["style"] == "grid-template-columns:repeat(2,1fr)"
    assert _cells(dom) == [("rank 0", "(8, 1)", "at (0, 0)", ["rank"]), ("rank 1", "(8, 1)", "at (0, 1)", ["rank"]),
                           ("rank 2", "(8, 1)", "at (0, 2)", ["rank"]),
                           ("rank 3", "empty (8, 0)", "at (0, 3)", ["rank", "empty"])]
    # the phase filter: backward only
    rows = [r for r in dom.one("table", id="collective-list").all("tr") if "data-phase" in r.attrs]
    assert len(rows) == len(plan.collectives) == 10
    shown = [r for r in rows if r.visible()]
    assert [r.attrs["data-phase"] for r in shown] == ["backward"] * plan.count(phase="backward")
    assert dom.one(id="shown-count").text == f"{plan.count(phase='backward')} shown"
    assert [i.attrs["value"] for i in dom.one(id="phase-filter").all("input") if "checked" in i.attrs] == \
        ["backward"]
    # the estimate of each collective is the cost model's, and they add up to the plan's communication
    estimates = [r.all("td")[5].text for r in rows]
    assert all(e.endswith("µs") for e in estimates), estimates
    assert sum(c.seconds for c in plan.collectives) == pytest.approx(plan.cost.comm_s)
    # the memory per rank: one line through the forward and on through the backward (its ops in reverse), a
    # mark where the backward begins, its highest point the plan's peak
    memory = dom.one("svg", id="memory")
    xy = [tuple(map(float, p.split(","))) for p in memory.one("polyline").attrs["points"].split()]
    forward = sum(n.live_bytes is not None for n in plan.nodes.values())
    backward = sum(n.backward_live_bytes is not None for n in plan.nodes.values())
    # (the detach of relu's saved output carries no gradient: no backward point)
    assert (forward, backward) == (7, 3) and len(xy) == forward + backward == int(memory.attrs["data-points"])
    assert int(memory.attrs["data-forward-points"]) == forward
    assert xy[forward - 1][0] < float(memory.one("line", "boundary").attrs["x1"]) < xy[forward][0]
    peak = float(memory.one("line", "peak").attrs["y1"])
    assert min(y for _, y in xy) == peak == min(y for _, y in xy[forward:]) < min(y for _, y in xy[:forward])
    heights = [80 - y for _, y in xy]  # drawn to scale: the peak at the top
    # (the forward ends at mm_1: 248 B and the caller's whole arguments beside their pieces, 336 B, as
    # tests/strategy_search/test_cost_model.py reckons it)
    assert max(heights) == 80 and heights[forward - 1] == pytest.approx(80 * (248 + 336) / plan.cost.peak_bytes,
                                                                        abs=0.1)
    assert "over the forward and backward" in dom.one(id="memory-title").text

    dom = _browse(page, tmp_path, f"#t={relu}")
    assert dom.one(id="layout-placements").text == "(S(1),S(0))"
    assert dom.one(id="layout-origin").text == "layout from: chosen by the search (rule dtensor)"
    # columns cut 2 + 1 over the mesh's rows, rows 3 + 3 over its columns: the shorter pieces marked uneven
    assert _cells(dom) == [("rank 0", "(3, 2)", "at (0, 0)", ["rank"]), ("rank 1", "(3, 2)", "at (3, 0)", ["rank"]),
                           ("rank 2", "(3, 1)", "at (0, 2)", ["rank", "uneven"]),
                           ("rank 3", "(3, 1)", "at (3, 2)", ["rank", "uneven"])]
    rows = [r for r in dom.one("table", id="collective-list").all("tr") if "data-phase" in r.attrs]
    assert len(rows) == 10 and all(r.visible() for r in rows)  # no phase asked: every collective shown
    # the tree: the function's ops at the top level, each with its rule and layouts
    top = _summaries(dom)["(top level)"]
    ops = {tr.all("td")[0].text: [td.text for td in tr.all("td")[1:5]] for tr in top.all("tr") if tr.all("td")}
    partial = placements_text(plan.nodes["mm_1"].outputs[0])  # "(P(sum),S(0))": a release's spelling of P
    assert ops["mm_1"] == ["mm", "dtensor", "(S(1),S(0)), (S(0),R)", partial] and partial.startswith("(P")
    assert set(ops) == {"input 0", "input 1", "input 2", "mm", "relu", "detach", "mm_1"}


def test_the_pages_pieces_are_dtensors(tmp_path):
    # every piece the page draws is the one DTensor's own chunking gives (its private helper, read apart)
    plan = _two_matmuls()
    text = Path(plan.to_html(str(tmp_path / "plan.html"))).read_text()
    data = json.loads(_parse(text).one("script", id="plan-data").text)
    mesh = torch.arange(4).reshape(2, 2)

    class Shape:  # local_pieces reads the mesh's shape only
        shape = tuple(mesh.shape)

    drawn = [t for t in data["tensors"].values() if "pieces" in t]
    assert len(drawn) == len(data["tensors"]) == 3 + 1 + 4  # inputs, the output, the four ops
    assert {t["placements"] for t in drawn} >= {"(S(1),S(1))", "(S(1),S(0))",
                                                 placements_text(plan.nodes["mm_1"].outputs[0])}
    for t in drawn:
        placements = tuple(parse_placement(p) for p in t["placements"][1:-1].split(","))
        assert [(tuple(p[2]), tuple(p[3])) for p in t["pieces"]] == \
            local_pieces(tuple(t["shape"]), placements, Shape), t["name"]
        assert [p[:2] for p in t["pieces"]] == [[0, [0, 0]], [1, [0, 1]], [2, [1, 0]], [3, [1, 1]]]  # row-major


# -- (b) a transformers Llama under Megatron ------------------------------------------------------------------------

def _llama(layers: int = 4) -> Plan:
    import transformers as tf

    from tests.transformers_models import _decoder_config

    spec = MODELS["llama"]
    config = _decoder_config(tf.LlamaConfig)
    config.num_hidden_layers = layers
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    plan = {k: v for i in range(layers) for k, v in megatron(spec, 4, f"model.layers.{i}.").items()}
    (ids,), kwargs = batch(spec, seed=0)
    return sf.explain(model, ids, kwargs=kwargs, in_strategy=(None,), parameter_plan=plan, world_size=4)


def test_a_llama_page_folds_its_layers(tmp_path):
    plan = _llama()
    page = Path(plan.to_html(str(tmp_path / "llama.html")))
    assert page.stat().st_size < 200_000
    raw = _parse(page.read_text())
    q_proj = _link(raw, "model.layers.0.self_attn.q_proj.weight")
    assert "model.layers.1.self_attn.q_proj.weight" not in page.read_text()  # folded: written out once

    dom = _browse(page, tmp_path, f"#t={q_proj}")
    modules = _summaries(dom)
    # model > layers > the four layers as one, open, with its count, and its submodules down to the ops
    folded = modules["0-3 (x4)"]
    assert folded.attrs["data-count"] == "4" and "open" in folded.attrs
    assert _own_label(folded.parent) == "layers" and _own_label(folded.parent.parent) == "model"
    assert not {"0", "1", "2", "3"} & set(modules)
    summary = next(c for c in folded.children if c.tag == "summary").text
    in_layers = sum(n.op != "input" and n.module.startswith("model.layers.") for n in plan.nodes.values())
    assert f"4 layers: {in_layers} ops" in summary
    attention = next(d for d in folded.all("details", "module") if _own_label(d) == "self_attn")
    q_rows = [tr for d in attention.all("details", "module") if _own_label(d) == "q_proj" for tr in d.all("tr")]
    assert [tr.all("td")[1].text for tr in q_rows if tr.all("td")][:2] == ["input", "t"]
    assert [d.one("span", "lname").text for d in dom.all("div", "layer")][:2] == \
        ["model.embed_tokens", "model.layers.0-3 (x4)"]

    # the parameter's pieces: a quarter of the rows each, from the parameter_plan
    assert dom.one(id="layout-name").text == "model.layers.0.self_attn.q_proj.weight"
    assert dom.one(id="layout-origin").text == "layout from: given by the caller (parameter_plan)"
    assert _cells(dom) == [(f"rank {r}", "(16, 64)", f"at ({16 * r}, 0)", ["rank"]) for r in range(4)]
    rows = [r for r in dom.one("table", id="collective-list").all("tr") if "data-phase" in r.attrs]
    assert len(rows) == len(plan.collectives) and all(r.visible() for r in rows)
    assert {r.all("td")[8].text for r in rows} >= {"model.layers.0-3 (x4)", "lm_head"}
    origins = {i.name: i.origin for i in plan.inputs}
    assert origins["model.layers.0.self_attn.q_proj.weight"] == "parameter_plan"
    assert origins["model.layers.0.input_layernorm.weight"] == "search"
    assert origins["model.rotary_emb.inv_freq"] == "buffer" and origins["input 0"] == "search"


# -- (c) a module that ran: its measured step next to the estimate ----------------------------------------------------

def test_a_plan_that_ran_shows_its_measured_step(tmp_path):
    from shardfn.runtime import simulated_world

    torch.manual_seed(0)
    with simulated_world(2):
        model = sf.shard(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                         in_strategy=(None,))
        x = torch.randn(4, 8)
        assert sf.explain(model, x).measured_s is None  # nothing ran yet
        steps = []
        for _ in range(4):
            start = time.perf_counter()
            model(x).sum().backward()
            steps.append(time.perf_counter() - start)
        plan = sf.explain(model, x)
        with torch.no_grad():  # a signature of its own: its forward alone
            for _ in range(3):
                model(x)
            inference = sf.explain(model, x)
    # the median of the three steps after the first (which captured, planned and traced); each inside its whole
    # step as timed around it (the loss and the call into backward besides)
    assert plan.measured == ("forward+backward of the last 3 calls, median (wall clock; the first call, which "
                             "captured, planned and traced, left out)")
    assert 0 < plan.measured_s <= sorted(steps[1:])[1]
    assert inference.measured.startswith("forward (no gradients) of the last 2 calls, median")
    # the program's own plan is not changed: the measurement is handed to the plan read from it
    assert all(c.plan.measured_s is None for c in sf.engine_of(model).programs.values())
    back = Plan.from_json(plan.to_json())
    assert (back.measured_s, back.measured) == (plan.measured_s, plan.measured)

    dom = _browse(Path(plan.to_html(str(tmp_path / "ran.html"))), tmp_path)
    facts = {tr.attrs["data-fact"]: tr.one("td").text for tr in dom.one("table", id="facts").all("tr")}
    measured = re.escape(_seconds(plan.measured_s))
    assert re.fullmatch(measured + r": forward\+backward of the last 3 calls, median \(wall clock; .*\)",
                        facts["measured step"]), facts
    assert facts["estimated step"].startswith(_seconds(plan.cost.total_s) + " = compute")
    assert facts["peak memory"] == f"{_bytes(plan.cost.peak_bytes)} per rank"


# -- the plan file ----------------------------------------------------------------------------------------------------

def test_json_round_trip_and_the_command(tmp_path):
    # what exec reads of a plan besides its placements travels too: the name, pending gradients, the precision
    plan = dataclasses.replace(_two_matmuls(), measured_s=0.0125, name="two_matmuls", pending_grads={"w"},
                               precision=Precision(torch.bfloat16, torch.float32, None))
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back.to_json() == text and json.loads(text)["shardfn_plan_format"] == PLAN_FORMAT
    assert (back.name, back.pending_grads, back.precision) == ("two_matmuls", {"w"}, plan.precision)
    assert back.inputs == plan.inputs and back.collectives == plan.collectives and back.nodes == plan.nodes
    assert str(back) == str(plan) and back.mesh == plan.mesh
    saved = tmp_path / "plan.json"
    saved.write_text(text)
    out = subprocess.run([sys.executable, "-m", "shardfn.show", str(saved), "-o", str(tmp_path / "page.html")],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "page.html").read_text() == Path(plan.to_html(str(tmp_path / "direct.html"))).read_text()
    assert "12.500 ms" in (tmp_path / "page.html").read_text()  # the measured step, next to the estimate


@pytest.mark.parametrize("content, message", [
    ("<html>a page</html>", "not a shardfn plan file (not JSON"),
    ('{"mesh": {}}', "not a shardfn plan file (no 'shardfn_plan_format' field"),
    ('[1, 2]', "not a shardfn plan file (no 'shardfn_plan_format' field"),
    ('{"shardfn_plan_format": 99, "nodes": []}', f"written by plan format 99, this shardfn reads {PLAN_FORMAT}"),
    ("truncated", "not a shardfn plan file (a field is missing"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not a shardfn plan file (not UTF-8"),
])
def test_a_file_that_is_not_a_plan_is_named(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    if content == "truncated":  # a plan with a field cut away
        data = json.loads(_two_matmuls().to_json())
        del data["collectives"]
        content = json.dumps(data)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match="^" + re.escape(str(path)) + ": ") as raised:
        Plan.load(str(path))
    assert message in str(raised.value)
    assert show_main([str(path)]) == 1
    assert capsys.readouterr().err == f"python -m shardfn.show: {raised.value}\n"
    assert not (tmp_path / "bad.html").exists()


def test_the_plans_stage_imports_no_presentation():
    # Plan.to_html draws with the writer show.plan_page registers (strategy_search.plan.set_page_writer): no module
    # of the search imports show, not even inside a function
    import ast

    import shardfn.strategy_search as search
    from shardfn.strategy_search import plan as plan_module

    folder = Path(search.__file__).parent
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.split(".")[-1] == "show" or ".show" in n or n.startswith("show") for n in names):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
    from shardfn.show.plan_page import write_page
    assert plan_module._PAGE_WRITER is write_page
