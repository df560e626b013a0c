"""The report escapes every value it shows: markup in a result's environment, its route, a baseline directory's
name and a passed variable reaches report.html as text, never as a tag or an attribute, and report.md carries no
tag either. Built from the hand-made results of tests/test_report.py (no Snakemake, no models)."""

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from shapewise.inputs import paths
from shapewise.report import report

from test_report import make_run, write_json  # tests/ is on sys.path under pytest

# Closes a double-quoted attribute, then opens a script and an image with a handler.
PAYLOAD = '"><script>alert(1)</script><img src=x onerror=alert(2)>'
# A directory name can hold all of it but the slash of </script>.
DIR_PAYLOAD = '"><img src=x onerror=alert(3)>'


class _Page(HTMLParser):
    """The tags, attributes and text of a page as a browser's parser splits them."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.attributes, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attributes += attrs

    def handle_data(self, data):
        self.text.append(data)


def _parse(text):
    page = _Page()
    page.feed(text)
    page.close()
    return page


def _template_tags():
    """The tags the HTML dialect of the report's template writes (report.j2 itself writes none)."""
    return set(re.findall(r"<([a-z][a-z0-9]*)", (paths.TEMPLATES / "html.j2").read_text()))


def _poison(root, inputs):
    """Put PAYLOAD into what the report shows of every result: the environment, the route, a GPU and a process
    of the timing result, and a resource skip's reason."""
    for entry in inputs["rows"]:
        for step, path in entry["results"].items():
            data = json.loads((root / path).read_text())
            env = data["environment"]
            for field in ("host", "cpu", "gpu_name", "driver", "torch_full", "triton", "python", "packages_sha256"):
                env[field] = f"{field}{PAYLOAD}"
            env["machine_key"] = f"machine{PAYLOAD}"
            env["shapewise_variables"] = {"SHAPEWISE_NOTE": PAYLOAD}
            for result_field in ("route", "route_detail"):
                if data.get(result_field):
                    data[result_field] = (PAYLOAD if result_field == "route"
                                          else dict(data[result_field], name=f"fused{PAYLOAD}"))
            if step == "accuracy" and data.get("skip_reason"):
                data["skip_reason"] = PAYLOAD
            if step == "timing" and isinstance(data.get("gpu"), dict):
                data["gpu"].update(uuid=PAYLOAD, slot_source=PAYLOAD)
                data["contention"]["other_processes"][0]["name"] = PAYLOAD
            write_json(root / path, data)
    micro = json.loads((root / paths.MICROBENCH).read_text())
    micro["environment"] = dict(micro["environment"], host=PAYLOAD, cpu=PAYLOAD, gpu_name=PAYLOAD,
                                shapewise_variables={"SHAPEWISE_NOTE": PAYLOAD})
    write_json(root / paths.MICROBENCH, micro)
    return dict(inputs, pass_env={"SHAPEWISE_NOTE": PAYLOAD})


@pytest.fixture
def poisoned(tmp_path, monkeypatch):
    """A rendered report whose results and passed variable hold markup, then rendered again against a baseline
    directory named with markup."""
    monkeypatch.chdir(tmp_path)
    inputs = _poison(tmp_path, make_run(tmp_path))
    report.render(inputs, "results/report")
    shutil.copytree("results/report", DIR_PAYLOAD)
    context = report.render(dict(inputs, baseline=DIR_PAYLOAD), "results/report")
    assert context["baseline"]["path"] == DIR_PAYLOAD
    out = tmp_path / "results" / "report"
    return (out / "report.html").read_text(), (out / "report.md").read_text()


def test_html_carries_no_markup_of_the_values(poisoned):
    html_text, _ = poisoned
    page = _parse(html_text)
    assert set(page.tags) <= _template_tags(), set(page.tags) - _template_tags()
    assert "script" not in page.tags
    assert not [name for name, _ in page.attributes if name.startswith("on")], page.attributes
    assert not [value for name, value in page.attributes if name == "src" and value == "x"]
    # the values are there, as text a reader sees
    text = "".join(page.text)
    for shown in (f"host{PAYLOAD}", f"cpu{PAYLOAD}", f"machine{PAYLOAD}", f"SHAPEWISE_NOTE={PAYLOAD}", DIR_PAYLOAD):
        assert shown in text, shown
    # attribute values keep the payload inside the attribute (the route's full text is its link's title)
    assert ("title", PAYLOAD) in page.attributes


def test_markdown_carries_no_tag(poisoned):
    _, md = poisoned
    assert "<script" not in md and "<img" not in md
    assert "&lt;script>alert(1)&lt;/script>&lt;img src=x onerror=alert(2)>" in md
    assert "&lt;img src=x onerror=alert(3)>" in md  # the baseline's name


def test_a_value_with_a_line_break_stays_on_its_line():
    assert report.md_value("node1\n# Injected heading\n- item") == "node1 \\# Injected heading - item"
    assert report.md_value(3) == "3"


def test_markdown_characters_of_a_value_are_escaped():
    assert report.md_text("a|b`c*d_e [x](y) [r][d] [t] ~~s~~ fused_layer _init_ \\ &amp; & <b>") == \
        "a\\|b\\`c\\*d_e [x\\](y) [r\\][d] [t] \\~\\~s\\~\\~ fused_layer \\_init\\_ \\\\ &amp;amp; & &lt;b>"


def test_code_spans_hold_any_backtick_and_pipe():
    assert report.md_code("model(x)") == "`model(x)`"
    assert report.md_code("a`b") == "``a`b``"
    assert report.md_code("`x``") == "``` `x`` ```"
    assert report.md_code("a|b") == "`a|b`"
    assert report.md_code("a|b", cell=True) == "`a\\|b`"
    assert report.md_code("a\nb") == "`a b`"
    assert report.md_code("<img>") == "&lt;img>"  # no code span: no viewer reads a tag in it


PIPES = "x|y`z``w|"


def _cells(line):
    """The cells of a GitHub table row, split where GitHub splits them: on each `|` without a backslash before it
    (inside a code span too)."""
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


def test_markdown_tables_keep_their_columns_with_pipes_and_backticks(tmp_path, monkeypatch):
    """A `|` or a backtick in a route, a machine key or a path leaves every row of every table of report.md with
    its header's number of cells, and every code span closed on its line."""
    monkeypatch.chdir(tmp_path)
    inputs = make_run(tmp_path)
    for entry in inputs["rows"]:
        for path in entry["results"].values():
            data = json.loads((tmp_path / path).read_text())
            data["environment"]["machine_key"] = f"machine{PIPES}"
            if data.get("route"):
                data["route"] = f"fused/{PIPES} (auto: {PIPES})"
            write_json(tmp_path / path, data)
    report.render(dict(inputs, pass_env={}), "results/report")
    md = (tmp_path / "results/report/report.md").read_text()
    lines = md.splitlines()
    tables = 0
    for i, line in enumerate(lines):
        if re.fullmatch(r"\|(:?-+:?\|)+", line):  # a header's delimiter row
            tables += 1
            width = len(_cells(lines[i - 1]))
            assert len(_cells(line)) == width
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                assert len(_cells(row)) == width, row
    assert tables >= 5
    assert f"machine{PIPES}".replace("|", "\\|").replace("`", "\\`") in md
    routes = md.split("## Routes", 1)[1].split("\n## ", 1)[0]
    assert "`` fused/x|y`z``w| ``" not in routes and "```fused/x|y`z``w|```" in routes


def test_html_escaping_keeps_markup_of_the_template_and_escapes_values():
    assert str(report.html_value('a"b<c>&d\'e')) == "a&quot;b&lt;c&gt;&amp;d'e"
    env = report.environments()["html"]
    rendered = env.from_string('{% macro m(v) %}<b>{{ v }}</b>{% endmacro %}<i title="{{ v }}">{{ m(v) }}</i>') \
        .render(v="<u>")
    assert rendered == '<i title="&lt;u&gt;"><b>&lt;u&gt;</b></i>'


def test_every_attribute_of_the_html_template_is_double_quoted():
    """html_value leaves ' as it is: safe only while no attribute of report.html.j2 is single-quoted or bare."""
    text = (paths.TEMPLATES / "html.j2").read_text()
    text = re.sub(r"{%.*?%}|{{.*?}}|{#.*?#}", "X", text, flags=re.S)  # Jinja code may quote as it likes
    tags = re.findall(r"<[a-z][^<>]*>", text)
    assert len(tags) > 20
    for tag in tags:
        bare = re.sub(r'"[^"]*"', '""', tag)  # what is left outside double-quoted values
        for name, value in re.findall(r"\s([a-z-]+)=(\S)", bare):
            assert value == '"', f"attribute {name} of {tag} is not double-quoted"


def test_the_report_text_holds_no_markup_of_either_page():
    """report.j2 and candidates.j2 write the text once; every tag and every Markdown mark is a dialect's."""
    for name in ("report.j2", "candidates.j2"):
        text = re.sub(r"{%.*?%}|{{.*?}}|{#.*?#}", "", (paths.TEMPLATES / name).read_text(), flags=re.S)
        assert not re.search(r"<[a-z/]|\*\*|`|^#|^- |^\|", text, re.M), name


def test_nothing_in_the_templates_is_marked_safe():
    for template in paths.TEMPLATES.glob("*.j2"):
        text = template.read_text()
        assert "|safe" not in text.replace(" ", "") and "Markup" not in text, template
        assert "autoescape false" not in text, template
    source = Path(report.__file__).read_text()
    assert "Markup(" in source and source.count("Markup(") == 1  # html_value's own, over escaped text only
