"""A renderer for the small subset of Helm's template language that `infra/helm/stoker` uses.

No helm binary can be installed here (no package registry ships one, and there is no Go toolchain),
so the tests render the chart with this instead. It implements only what the chart needs, and
raises `TemplateError` on anything else, so the chart cannot drift beyond what is checked:

- actions `{{ pipeline }}`, with `{{-` / `-}}` trimming the whitespace beside them, and comments
  `{{/* ... */}}`;
- operands: fields `.Values.a.b`, `.`, `$`, `$.Values.a`; variables `$x`, `$x.a.b`, set by
  `{{ $x := pipeline }}` and seen to the end of the block that set them (an include starts with
  none); strings in double quotes; integers; `true`, `false`; parenthesised pipelines;
- pipes `a | f x`, which pass `a` as f's last argument, as Go's text/template does;
- `define "name"` (in any file), `if` / `else if` / `else`, `with` / `else`, `end`;
- functions: include, required, default, quote, toYaml, indent, nindent, printf (%s of strings),
  trunc (n >= 0), trimSuffix, not, and, int (of a number), list, dict, index (of a map), b64enc; lookup, which answers from the
  objects `render_chart` is given as the cluster's (none: an empty map, as `helm template` and an
  install answer); genCA and genSignedCert, which make real certificates (ECDSA P-256 keys here,
  where Helm's are RSA 2048: what reads them takes either).

Semantics follow Helm 3: a missing key of `.Values` is empty and prints as nothing; a field of an
empty value is an error (Helm's "nil pointer evaluating"); `.Release` has only Name, Namespace and
Service, `.Chart` only Name, Version and AppVersion; files whose names start with `_` produce no
output; numbers are printed only when Go would print them the same way (values are float64 in
Helm, so 1000000 prints as 1e+06); maps and lists are printed only through toYaml.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class TemplateError(Exception):
    """A construct helmlite does not implement, or a template that Helm would refuse to render."""


class RequiredError(TemplateError):
    """`required` met an empty value: Helm fails the install with the same message."""


# --- lexing -------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<assign>\$[A-Za-z_]\w*\s*:=)
      | (?P<var>\$[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)
      | (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<number>-?\d+)(?![\w.])
      | (?P<field>\$?(?:\.[A-Za-z_]\w*)+|\.|\$)
      | (?P<ident>[A-Za-z_]\w*)
      | (?P<punct>[|()])
    )""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class Token:
    kind: str  # string, number, field, ident, punct
    text: str


def _tokens(action: str) -> list[Token]:
    out, pos = [], 0
    while action[pos:].strip():
        m = _TOKEN.match(action, pos)
        if m is None:
            raise TemplateError(f"helmlite does not understand {action[pos:].strip()!r} in {{{{{action}}}}}")
        kind = m.lastgroup
        out.append(Token(kind, m.group(kind)))
        pos = m.end()
    return out


def _split_actions(source: str, name: str) -> list[tuple[str, str]]:
    """The template as ("text", s) and ("action", s) pieces, whitespace trimmed where `{{-`/`-}}` ask."""
    pieces: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    while (start := source.find("{{", pos)) != -1:
        text = source[pos:start]
        end = _action_end(source, start, name)
        inner = source[start + 2 : end]
        trim_before, trim_after = inner.startswith("- "), inner.endswith(" -")
        if (inner.startswith("-") and not trim_before) or (inner.endswith("-") and not trim_after):
            raise TemplateError(f"{name}: a trim marker needs a space beside it: {{{{{inner}}}}}")
        inner = inner[2 if trim_before else 0 : len(inner) - 2 if trim_after else len(inner)]
        if trim_next:
            text = text.lstrip()
        if trim_before:
            text = text.rstrip()
        pieces.append(("text", text))
        if not (inner.strip().startswith("/*") and inner.strip().endswith("*/")):
            pieces.append(("action", inner.strip()))
        pos, trim_next = end + 2, trim_after
    pieces.append(("text", source[pos:].lstrip() if trim_next else source[pos:]))
    return [p for p in pieces if p != ("text", "")]


def _action_end(source: str, start: int, name: str) -> int:
    """Where the action opened at `start` closes, skipping `}}` inside strings and comments."""
    i, comment = start + 2, source[start + 2 :].lstrip("- ").startswith("/*")
    if comment:
        close = source.find("*/", start)
        i = close + 2 if close != -1 else len(source)
    while i < len(source):
        if source.startswith("}}", i):
            return i
        if source[i] == '"':
            i += 1
            while i < len(source) and source[i] != '"':
                i += 2 if source[i] == "\\" else 1
        i += 1
    raise TemplateError(f"{name}: an action opened at offset {start} is never closed")


# --- parsing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    from_root: bool  # $.a.b (or $) rather than .a.b (or .)
    path: tuple[str, ...]


@dataclass(frozen=True)
class Var:
    name: str
    path: tuple[str, ...]


@dataclass(frozen=True)
class Assign:
    name: str
    value: Pipeline


@dataclass(frozen=True)
class Literal:
    value: Any


@dataclass(frozen=True)
class Function:
    name: str


@dataclass(frozen=True)
class Pipeline:
    commands: tuple[tuple[Any, ...], ...]  # each command: operands (Field, Literal, Function, Pipeline)


@dataclass
class Branch:
    keyword: str  # if, with
    condition: Pipeline
    body: list = field(default_factory=list)


@dataclass
class Block:
    """An if/else-if/else chain or a with/else: the first branch whose condition holds is rendered."""

    branches: list[Branch]
    otherwise: list | None = None


_LITERALS = {"true": True, "false": False}


def _parse_pipeline(tokens: list[Token], pos: int, nested: bool) -> tuple[Pipeline, int]:
    commands, operands = [], []
    while pos < len(tokens):
        tok = tokens[pos]
        if tok.text == ")" and tok.kind == "punct":
            if not nested:
                raise TemplateError("helmlite: an unmatched ')'")
            break
        pos += 1
        if tok.kind == "punct" and tok.text == "|":
            if not operands:
                raise TemplateError("helmlite: a pipe with nothing before it")
            commands.append(tuple(operands))
            operands = []
        elif tok.kind == "punct" and tok.text == "(":
            sub, pos = _parse_pipeline(tokens, pos, nested=True)
            if pos >= len(tokens):
                raise TemplateError("helmlite: an unclosed '('")
            pos += 1
            operands.append(sub)
        elif tok.kind == "string":
            operands.append(Literal(json.loads(tok.text)))
        elif tok.kind == "number":
            operands.append(Literal(int(tok.text)))
        elif tok.kind == "var":
            name, *path = tok.text[1:].split(".")
            operands.append(Var(name, tuple(path)))
        elif tok.kind == "assign":
            raise TemplateError("helmlite: ':=' only as `{{ $x := pipeline }}`")
        elif tok.kind == "field":
            from_root = tok.text.startswith("$")
            operands.append(Field(from_root, tuple(p for p in tok.text.lstrip("$").split(".") if p)))
        elif tok.text in _LITERALS:
            operands.append(Literal(_LITERALS[tok.text]))
        elif tok.text in FUNCTIONS:
            if operands:
                raise TemplateError(f"helmlite: function {tok.text!r} must start a command")
            operands.append(Function(tok.text))
        else:
            raise TemplateError(f"helmlite does not implement {tok.text!r}")
    if not operands:
        raise TemplateError("helmlite: an empty command")
    commands.append(tuple(operands))
    return Pipeline(tuple(commands)), pos


def parse_pipeline(text: str) -> Pipeline:
    tokens = _tokens(text)
    pipeline, pos = _parse_pipeline(tokens, 0, nested=False)
    if pos != len(tokens):
        raise TemplateError(f"helmlite: unexpected {tokens[pos].text!r} in {{{{ {text} }}}}")
    return pipeline


def parse(source: str, name: str) -> tuple[list, dict[str, list]]:
    """A file's body (a list of str, Pipeline and Block) and the templates it defines."""
    body: list = []
    defines: dict[str, list] = {}
    stack: list[tuple[str, Any, list]] = []  # (kind, Block or define name, the body being filled)
    current = body
    for kind, text in _split_actions(source, name):
        if kind == "text":
            current.append(text)
            continue
        keyword, _, rest = text.partition(" ")
        if keyword in ("if", "with"):
            block = Block([Branch(keyword, parse_pipeline(rest))])
            current.append(block)
            stack.append((keyword, block, current))
            current = block.branches[0].body
        elif keyword == "else":
            if not stack or stack[-1][0] not in ("if", "with") or stack[-1][1].otherwise is not None:
                raise TemplateError(f"{name}: an 'else' outside an if/with, or a second one")
            block = stack[-1][1]
            if rest.startswith("if "):
                if stack[-1][0] != "if":
                    raise TemplateError(f"{name}: helmlite does not implement 'else if' after 'with'")
                block.branches.append(Branch("if", parse_pipeline(rest[3:])))
                current = block.branches[-1].body
            elif rest:
                raise TemplateError(f"helmlite does not implement {{{{ else {rest} }}}}")
            else:
                block.otherwise = []
                current = block.otherwise
        elif keyword == "define":
            if stack:
                raise TemplateError(f"{name}: 'define' is allowed only at the top of a file")
            define = parse_pipeline(rest).commands
            if len(define) != 1 or len(define[0]) != 1 or not isinstance(define[0][0], Literal):
                raise TemplateError(f"{name}: 'define' takes one quoted name")
            stack.append(("define", define[0][0].value, current))
            current = []
        elif keyword == "end":
            if rest or not stack:
                raise TemplateError(f"{name}: an unmatched {{{{ end }}}}")
            kind_, what, outer = stack.pop()
            if kind_ == "define":
                defines[what] = current
            current = outer
        elif (tokens := _tokens(text)) and tokens[0].kind == "assign":
            value, pos = _parse_pipeline(tokens, 1, nested=False)
            if pos != len(tokens):
                raise TemplateError(f"helmlite: unexpected {tokens[pos].text!r} in {{{{ {text} }}}}")
            current.append(Assign(tokens[0].text[1:].rstrip(":= "), value))
        else:
            current.append(parse_pipeline(text))
    if stack:
        raise TemplateError(f"{name}: {{{{ {stack[-1][0]} }}}} is never closed with {{{{ end }}}}")
    return body, defines


# --- evaluation ---------------------------------------------------------------------------------


class Struct(dict):
    """`.Release`, `.Chart` and the top-level object: Go structs, so an unknown field is an error."""


def truthy(value: Any) -> bool:
    """Go's rule for if/with/and/or/not: false, 0, nil and empty strings, lists and maps are false."""
    return value not in (None, False, 0, "") and value != [] and value != {}


def go_string(value: Any) -> str:
    """How `{{ value }}` prints: only the kinds Go and Python print alike."""
    if value is None:
        return ""  # Helm turns "<no value>" into ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and abs(value) < 1_000_000:
        return str(value)
    if isinstance(value, str):
        return value
    raise TemplateError(f"helmlite refuses to print {value!r} directly (Helm would print it differently)")


def _to_yaml(value: Any) -> str:
    if not isinstance(value, dict | list):
        raise TemplateError(f"helmlite's toYaml takes a map or a list, not {value!r}")
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=True, width=1 << 30).removesuffix("\n")


def _indent(n: int, text: str) -> str:
    pad = " " * n
    return pad + text.replace("\n", "\n" + pad)


def _printf(fmt: str, *args: Any) -> str:
    """Go's Sprintf for %s of strings only: numbers from values are float64 in Helm, so even %d
    of a value prints "%!d(float64=1)"."""
    verbs = re.findall(r"%(.)", fmt)
    if verbs != ["s"] * len(args) or not all(isinstance(a, str) for a in args):
        raise TemplateError(f"helmlite's printf takes %s of strings only: {fmt!r} {args!r}")
    return fmt % args


def _required(message: str, value: Any) -> Any:
    if value is None or value == "":
        raise RequiredError(message)
    return value


def _trunc(n: int, text: str) -> str:
    if n < 0:
        raise TemplateError("helmlite's trunc takes n >= 0")
    return text[:n]


def _and(*values: Any) -> Any:
    """Go's: the first false argument, else the last (every argument is evaluated here)."""
    if len(values) < 2:
        raise TemplateError("helmlite's and takes two arguments or more")
    return next((v for v in values if not truthy(v)), values[-1])


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TemplateError(f"helmlite's int takes a number, not {value!r}")
    return int(value)


def _dict(*pairs: Any) -> dict:
    if len(pairs) % 2 or not all(isinstance(k, str) for k in pairs[::2]):
        raise TemplateError(f"helmlite's dict takes key-value pairs with string keys: {pairs!r}")
    return dict(zip(pairs[::2], pairs[1::2], strict=True))


def _index(collection: Any, key: Any) -> Any:
    if not isinstance(collection, dict) or isinstance(collection, Struct):
        raise TemplateError(f"helmlite's index takes a map, not {collection!r}")
    return collection.get(key)


def _certificate(cn: str, ips: list, names: list, days: int, ca: Struct | None) -> Struct:
    """Sprig's genCA (`ca` None) and genSignedCert: `.Cert` and `.Key` in PEM; a CA is one only for
    signing, the signed certificate names `ips` and `names` (DNS), not `cn` unless listed."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not (isinstance(cn, str) and isinstance(days, int) and days > 0):
        raise TemplateError(
            f"helmlite: genCA/genSignedCert take a name and a number of days: {cn!r} {days!r}"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )
    if ca is None:
        builder = builder.issuer_name(subject).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), True
        )
        signer = key
    else:
        issuer = x509.load_pem_x509_certificate(ca["Cert"].encode())
        signer = serialization.load_pem_private_key(ca["Key"].encode(), None)
        alt = [x509.IPAddress(ipaddress.ip_address(i)) for i in ips or []]
        alt += [x509.DNSName(n) for n in names or []]
        builder = builder.issuer_name(issuer.subject).add_extension(x509.SubjectAlternativeName(alt), False)
    cert = builder.sign(signer, hashes.SHA256())
    pem = serialization.Encoding.PEM
    plain = serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    return Struct(Cert=cert.public_bytes(pem).decode(), Key=key.private_bytes(pem, *plain).decode())


def _arity(n: int, fn):
    def call(*args):
        if len(args) != n:
            raise TemplateError(f"helmlite: {fn.__name__.strip('_')} takes {n} arguments, got {len(args)}")
        return fn(*args)

    return call


FUNCTIONS = {
    "include": None,  # needs the renderer: handled in Renderer._call
    "required": _arity(2, _required),
    "default": _arity(2, lambda fallback, given: given if truthy(given) else fallback),
    "quote": _arity(1, lambda v: "" if v is None else json.dumps(go_string(v), ensure_ascii=False)),
    "toYaml": _arity(1, _to_yaml),
    "indent": _arity(2, _indent),
    "nindent": _arity(2, lambda n, text: "\n" + _indent(n, text)),
    "printf": _printf,
    "trunc": _arity(2, _trunc),
    "trimSuffix": _arity(2, lambda suffix, text: text.removesuffix(suffix)),
    "not": _arity(1, lambda v: not truthy(v)),
    "and": _and,
    "int": _arity(1, _int),
    "list": lambda *items: list(items),
    "dict": _dict,
    "index": _arity(2, _index),
    "b64enc": _arity(1, lambda text: base64.b64encode(go_string(text).encode()).decode()),
    "lookup": None,  # the cluster's objects: handled in Renderer._call
    "genCA": _arity(2, lambda cn, days: _certificate(cn, [], [], days, None)),
    "genSignedCert": _arity(5, lambda cn, ips, names, days, ca: _certificate(cn, ips, names, days, ca)),
}


@dataclass
class Renderer:
    defines: dict[str, list]
    cluster: dict[tuple[str, str, str, str], dict] = field(default_factory=dict)  # lookup's objects

    def render(self, nodes: list, dot: Any, root: Any, scope: dict | None = None) -> str:
        scope = {} if scope is None else scope  # this block's variables; an inner block copies them
        out = []
        for node in nodes:
            if isinstance(node, str):
                out.append(node)
            elif isinstance(node, Assign):
                scope[node.name] = self.pipeline(node.value, dot, root, scope)
            elif isinstance(node, Pipeline):
                out.append(go_string(self.pipeline(node, dot, root, scope)))
            else:
                out.append(self.block(node, dot, root, scope))
        return "".join(out)

    def block(self, block: Block, dot: Any, root: Any, scope: dict) -> str:
        for branch in block.branches:
            value = self.pipeline(branch.condition, dot, root, scope)
            if truthy(value):
                return self.render(branch.body, value if branch.keyword == "with" else dot, root, dict(scope))
        return self.render(block.otherwise or [], dot, root, dict(scope))

    def pipeline(self, pipeline: Pipeline, dot: Any, root: Any, scope: dict) -> Any:
        piped, first = None, True
        for command in pipeline.commands:
            head, *args = command
            values = [self.operand(a, dot, root, scope) for a in args] + ([] if first else [piped])
            if isinstance(head, Function):
                piped = self._call(head.name, values)
            elif values:
                raise TemplateError(f"helmlite: {head} is not a function, so it takes no arguments")
            else:
                piped = self.operand(head, dot, root, scope)
            first = False
        return piped

    def operand(self, operand: Any, dot: Any, root: Any, scope: dict) -> Any:
        if isinstance(operand, Literal):
            return operand.value
        if isinstance(operand, Pipeline):
            return self.pipeline(operand, dot, root, scope)
        if isinstance(operand, Var):
            if operand.name not in scope:
                raise TemplateError(f"helmlite: undefined variable ${operand.name}")
            value = scope[operand.name]
        else:
            value = root if operand.from_root else dot
        for i, name in enumerate(operand.path):
            value = _field(value, name, operand.path[:i])
        return value

    def _call(self, name: str, args: list) -> Any:
        if name == "lookup":
            if len(args) != 4 or not all(isinstance(a, str) for a in args):
                raise TemplateError("helmlite: lookup takes apiVersion, kind, namespace and name")
            return self.cluster.get(tuple(args), {})
        if name != "include":
            return FUNCTIONS[name](*args)
        if len(args) != 2 or args[0] not in self.defines:
            raise TemplateError(f"helmlite: include takes a defined template's name and a value: {args[:1]}")
        return self.render(self.defines[args[0]], args[1], args[1])


def _field(value: Any, name: str, before: tuple[str, ...]) -> Any:
    where = "." + ".".join((*before, name))
    if isinstance(value, Struct):
        if name not in value:
            raise TemplateError(f"helmlite: {where} is not a field Helm has (or helmlite knows)")
        return value[name]
    if isinstance(value, dict):
        return value.get(name)
    raise TemplateError(f"nil pointer evaluating {where}: {value!r} has no fields")


# --- the chart ----------------------------------------------------------------------------------


def merge(base: dict, override: dict) -> dict:
    """Helm's coalescing of user values over values.yaml: maps merge key by key, the rest replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def render_chart(
    chart: Path,
    values: dict | None = None,
    release: str = "stoker",
    namespace: str = "default",
    cluster: list[dict] = (),
) -> dict[str, str]:
    """Every template file's output, by file name (helper files, whose names start with `_`, omitted).
    `cluster`: the objects `lookup` finds (an upgrade's); none, as at an install or `helm template`.

    Only templates/ is read: Helm installs a chart's crds/ as plain YAML, before the templates and
    never rendered, so its files are no part of what this returns (tests/infra/test_crds.py checks them)."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    top = Struct(
        Values=merge(yaml.safe_load((chart / "values.yaml").read_text()) or {}, values or {}),
        Release=Struct(Name=release, Namespace=namespace, Service="Helm"),
        Chart=Struct(Name=meta["name"], Version=meta["version"], AppVersion=meta.get("appVersion")),
    )
    files, defines = {}, {}
    for path in sorted((chart / "templates").iterdir()):
        body, found = parse(path.read_text(), path.name)
        if clash := defines.keys() & found.keys():
            raise TemplateError(f"{path.name}: templates defined twice: {sorted(clash)}")
        defines |= found
        files[path.name] = body
    found = {
        (o["apiVersion"], o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
        for o in cluster
    }
    renderer = Renderer(defines, found)
    return {name: renderer.render(body, top, top) for name, body in files.items() if not name.startswith("_")}


def manifests(rendered: dict[str, str]) -> list[dict]:
    """The Kubernetes objects in the rendered YAML files, as Helm splits them on `---` lines."""
    docs = []
    for name, text in rendered.items():
        if name.endswith((".yaml", ".yml")):
            docs += [d for d in yaml.safe_load_all(text) if d is not None]
    return docs
