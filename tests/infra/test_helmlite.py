"""helmlite, the chart's stand-in for helm: each construct renders as Helm 3 renders it (the expected
outputs are what `helm template` prints for the same template), and everything outside the subset
is refused with an error instead of being rendered wrong.
"""

from __future__ import annotations

import pytest

from tests.infra.helmlite import RequiredError, TemplateError, render_chart

VALUES = {
    "name": "stoker",
    "empty": "",
    "port": 8080,
    "on": True,
    "off": False,
    "map": {"b": 2, "a": "x"},
    "list": [{"key": "gpu", "operator": "Exists"}],
    "nested": {"inner": "deep"},
    "big": 1000000,
}


def render(template: str, values: dict | None = None, helpers: str = "", tmp_path=None) -> str:
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 1.2.3\nappVersion: '4.5'\n")
    (chart / "values.yaml").write_text("")
    (chart / "templates" / "t.yaml").write_text(template)
    if helpers:
        (chart / "templates" / "_helpers.tpl").write_text(helpers)
    return render_chart(chart, VALUES if values is None else values, release="rel", namespace="ns")["t.yaml"]


RENDERS = [
    ("fields", "{{ .Values.name }}/{{ .Release.Name }}/{{ .Release.Namespace }}", "stoker/rel/ns"),
    ("chart fields", "{{ .Chart.Name }}-{{ .Chart.Version }}-{{ .Chart.AppVersion }}", "demo-1.2.3-4.5"),
    ("release service", "{{ .Release.Service }}", "Helm"),
    ("a missing key prints nothing", "[{{ .Values.missing }}]", "[]"),
    ("numbers and booleans", "{{ .Values.port }} {{ .Values.on }} {{ .Values.off }}", "8080 true false"),
    ("string literal", '{{ "a \\"b\\"" }}', 'a "b"'),
    ("trim before", "a  \n  {{- .Values.name }}", "astoker"),
    ("trim after", "{{ .Values.name -}}  \n  b", "stokerb"),
    ("trim both", "x\n{{- .Values.name -}}\ny", "xstokery"),
    ("a comment prints nothing", "a{{/* a comment with }} inside */}}b", "ab"),
    ("a trimmed comment", "a\n{{- /* note */ -}}\nb", "ab"),
    ("quote", "{{ .Values.name | quote }} {{ .Values.port | quote }}", '"stoker" "8080"'),
    ("quote of nothing is nothing", "[{{ .Values.missing | quote }}]", "[]"),
    ("default when empty", '{{ .Values.empty | default "d" }}', "d"),
    ("default when set", '{{ .Values.name | default "d" }}', "stoker"),
    ("default of false", '{{ .Values.off | default "d" }}', "d"),
    ("toYaml sorts keys", "{{ toYaml .Values.map }}", "a: x\nb: 2"),
    (
        "toYaml | nindent",
        "k:{{ .Values.list | toYaml | nindent 2 }}",
        "k:\n  - key: gpu\n    operator: Exists",
    ),
    ("indent pads every line", '{{ "a\\nb" | indent 2 }}', "  a\n  b"),
    ("printf", '{{ printf "%s-%s" .Values.name "x" }}', "stoker-x"),
    ("a variable", "{{ $n := .Values.nested }}{{ $n.inner }}-{{ $n.inner | quote }}", 'deep-"deep"'),
    (
        "a variable seen in an inner block",
        "{{ $x := .Values.name }}{{ if .Values.on }}{{ $x }}{{ end }}",
        "stoker",
    ),
    ("index of a map", '{{ index .Values.map "a" }}', "x"),
    ("dict", '{{ $d := dict "k" .Values.name "n" 1 }}{{ $d.k }}{{ toYaml $d }}', "stokerk: stoker\nn: 1"),
    ("b64enc", "{{ .Values.name | b64enc }}", "c3Rva2Vy"),
    (
        "and",
        "{{ and .Values.on .Values.name }}|{{ if and .Values.on .Values.off }}y{{ else }}n{{ end }}",
        "stoker|n",
    ),
    ("int", "{{ int .Values.port }}", "8080"),
    ("list", '{{ list "a" "b" | toYaml }}', "- a\n- b"),
    (
        "lookup finds nothing at an install",
        '{{ if lookup "v1" "Secret" "ns" "x" }}found{{ else }}none{{ end }}',
        "none",
    ),
    ("trunc", '{{ "abcdef" | trunc 3 }}', "abc"),
    ("trunc past the end", '{{ "ab" | trunc 63 }}', "ab"),
    ("trimSuffix", '{{ "abc-" | trimSuffix "-" }}', "abc"),
    (
        "pipe into a sub-pipeline's result",
        '{{ .Values.empty | default (printf "%s!" .Values.name) }}',
        "stoker!",
    ),
    ("not", "{{ not .Values.off }} {{ not .Values.name }}", "true false"),
    ("required when set", '{{ required "need it" .Values.name }}', "stoker"),
    ("if", "{{ if .Values.on }}yes{{ end }}", "yes"),
    ("if false", "{{ if .Values.off }}yes{{ end }}", ""),
    ("if on an empty map is false", "{{ if .Values.missing }}yes{{ else }}no{{ end }}", "no"),
    ("else if", "{{ if .Values.off }}a{{ else if .Values.name }}b{{ else }}c{{ end }}", "b"),
    ("else", "{{ if .Values.off }}a{{ else if .Values.empty }}b{{ else }}c{{ end }}", "c"),
    ("with moves the dot", "{{ with .Values.nested }}{{ .inner }}{{ end }}", "deep"),
    ("$ is the root inside with", "{{ with .Values.nested }}{{ $.Values.name }}{{ end }}", "stoker"),
    ("with on empty takes else", "{{ with .Values.empty }}x{{ else }}{{ .Values.name }}{{ end }}", "stoker"),
    ("nested blocks", "{{ if .Values.on }}{{ with .Values.nested }}{{ .inner }}{{ end }}{{ end }}", "deep"),
]


@pytest.mark.parametrize(("template", "expected"), [r[1:] for r in RENDERS], ids=[r[0] for r in RENDERS])
def test_renders_as_helm_does(template, expected, tmp_path):
    assert render(template, tmp_path=tmp_path) == expected


def test_include_renders_a_define_from_another_file_with_the_given_dot(tmp_path):
    helpers = '{{- define "x.name" -}}\n{{ .Values.name }}-{{ $.Release.Name }}\n{{- end }}\n'
    assert (
        render('[{{ include "x.name" . | quote }}]', helpers=helpers, tmp_path=tmp_path) == '["stoker-rel"]'
    )


def test_helper_files_produce_no_output(tmp_path):
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 1.0.0\n")
    (chart / "values.yaml").write_text("a: {b: 1, c: 2}\n")
    (chart / "templates" / "_helpers.tpl").write_text("text that Helm never prints\n")
    (chart / "templates" / "t.yaml").write_text("{{ .Values.a.b }}{{ .Values.a.c }}")
    assert render_chart(chart, {"a": {"b": 9}}) == {"t.yaml": "92"}  # user values merge over values.yaml


def test_required_fails_with_its_message(tmp_path):
    with pytest.raises(RequiredError, match=r"^set adminKey$"):
        render('{{ required "set adminKey" .Values.empty }}', tmp_path=tmp_path)


REFUSED = [
    ("range", "{{ range .Values.list }}x{{ end }}", "range"),
    ("reassigning a variable", "{{ $x := 1 }}{{ $x = 2 }}", "does not understand"),
    ("an undefined variable", "{{ $x }}", "undefined variable"),
    (
        "a variable out of its block",
        "{{ if .Values.on }}{{ $x := 1 }}{{ end }}{{ $x }}",
        "undefined variable",
    ),
    ("index of a list", "{{ index .Values.list 0 }}", "index takes a map"),
    ("dict of an odd count", '{{ dict "k" }}', "key-value pairs"),
    ("int of a string", '{{ int "3" }}', "int takes a number"),
    ("lookup of too little", '{{ lookup "v1" "Secret" }}', "lookup takes"),
    ("an unknown function", "{{ .Values.name | upper }}", "upper"),
    ("a field of nothing", "{{ .Values.missing.deeper }}", "nil pointer"),
    ("an unknown Release field", "{{ .Release.Revision }}", "Release.Revision"),
    ("printing a map", "{{ .Values.map }}", "refuses to print"),
    ("printing a number Go prints as 1e+06", "{{ .Values.big }}", "refuses to print"),
    ("toYaml of a scalar", "{{ toYaml .Values.name }}", "toYaml"),
    ("printf %d", '{{ printf "%d" .Values.port }}', "printf"),
    ("include of an undefined template", '{{ include "nope" . }}', "include"),
    ("an unclosed action", "{{ .Values.name ", "never closed"),
    ("an unclosed if", "{{ if .Values.on }}x", "never closed"),
    ("an extra end", "x{{ end }}", "unmatched"),
    ("a trim marker without a space", "{{-.Values.name }}", "trim marker"),
    ("a second else", "{{ if .Values.on }}a{{ else }}b{{ else }}c{{ end }}", "else"),
    ("else with", "{{ if .Values.on }}a{{ else with .Values.name }}b{{ end }}", "else with"),
    ("a function not first in its command", "{{ .Values.name quote }}", "must start"),
    ("a wrong argument count", "{{ trunc 3 }}", "takes 2 arguments"),
]


@pytest.mark.parametrize(("template", "error"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refuses_what_it_does_not_implement(template, error, tmp_path):
    with pytest.raises(TemplateError, match=error):
        render(template, tmp_path=tmp_path)


def test_lookup_answers_from_the_cluster_it_is_given(tmp_path):
    chart = tmp_path / "chart"
    render("", tmp_path=tmp_path)  # writes the chart
    (chart / "templates" / "t.yaml").write_text(
        '{{ with lookup "v1" "Secret" .Release.Namespace "old" }}{{ index .data "k" }}{{ end }}'
    )
    old = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "old", "namespace": "ns"},
        "data": {"k": "dg=="},
    }
    assert render_chart(chart, VALUES, release="rel", namespace="ns", cluster=[old])["t.yaml"] == "dg=="
    assert render_chart(chart, VALUES, release="rel", namespace="other", cluster=[old])["t.yaml"] == ""


def test_gen_ca_and_gen_signed_cert_make_a_certificate_the_ca_signed(tmp_path):
    from cryptography import x509

    template = (
        '{{ $ca := genCA "demo-ca" 30 }}{{ $c := genSignedCert "svc" (list "10.0.0.1") (list "svc" "svc.ns") 30 $ca }}'
        "{{ $ca.Cert | b64enc }} {{ $c.Cert | b64enc }} {{ $c.Key | b64enc }}"
    )
    import base64

    ca_pem, cert_pem, key_pem = (base64.b64decode(p) for p in render(template, tmp_path=tmp_path).split())
    ca, cert = x509.load_pem_x509_certificate(ca_pem), x509.load_pem_x509_certificate(cert_pem)
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["svc", "svc.ns"]
    assert [str(i) for i in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.1"]
    assert key_pem.startswith(b"-----BEGIN EC PRIVATE KEY-----")
