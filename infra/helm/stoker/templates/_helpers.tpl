{{/*
Named templates shared by the chart's files.

The chart keeps to the subset of Helm's template language that tests/infra/helmlite.py renders
(no helm binary is installable where the tests run): fields, variables, include of these defines,
if/else, with, and the functions include, required, default, quote, toYaml, indent, nindent,
printf, trunc, trimSuffix, not, and, int, list, dict, index, b64enc, lookup, genCA, genSignedCert. helmlite
refuses anything else, loudly.
*/}}

{{/* The prefix of every object's name: the release name, at most 40 characters. */}}
{{- define "stoker.fullname" -}}
{{ .Values.fullnameOverride | default .Release.Name | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "stoker.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "stoker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The labels selectors match on; each object adds app.kubernetes.io/component itself. */}}
{{- define "stoker.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stoker.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The address gateways and node agents reach the controller at (its Service): https:// with TLS. */}}
{{- define "stoker.controllerURL" -}}
{{ if .Values.tls.enabled }}https{{ else }}http{{ end }}://{{ include "stoker.fullname" . }}-controller:8081
{{- end }}

{{/* A ServiceMonitor's /metrics endpoint, with the admin key as its bearer token. */}}
{{- define "stoker.metricsEndpoint" -}}
- port: http
  path: /metrics
  interval: {{ .Values.serviceMonitor.interval }}
  authorization:
    type: Bearer
    credentials:
      name: {{ include "stoker.adminKeySecret" . }}
      key: {{ .Values.adminKey.key }}
{{- end }}

{{/* The TLS Secrets: the controller's certificate with the CA's ca.crt, and the engine pods' (tls.yaml). */}}
{{- define "stoker.tlsSecret" -}}
{{ .Values.tls.existingSecret | default (printf "%s-tls" (include "stoker.fullname" .)) }}
{{- end }}

{{- define "stoker.engineTlsSecret" -}}
{{- if .Values.tls.existingSecret }}
{{- .Values.tls.existingEngineSecret | default .Values.tls.existingSecret }}
{{- else }}
{{- printf "%s-engine-tls" (include "stoker.fullname" .) }}
{{- end }}
{{- end }}

{{/* Where a pod has the TLS Secret's items (read-only), and the flags that name them. */}}
{{- define "stoker.tlsDir" -}}
/etc/stoker/tls
{{- end }}

{{/* The CA alone: what gateways and node agents verify the controller (and the engines) with. */}}
{{- define "stoker.tlsCaArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-ca
- {{ include "stoker.tlsDir" . }}/ca.crt
{{- end }}
{{- end }}

{{/* The volume of the TLS Secret's items a pod needs: "ca" (ca.crt) or "server" (and tls.crt, tls.key). */}}
{{- define "stoker.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ include "stoker.tlsSecret" .root }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
      {{- if .server }}
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      {{- end }}
{{- end }}

{{- define "stoker.tlsMount" -}}
- name: tls
  mountPath: {{ include "stoker.tlsDir" . }}
  readOnly: true
{{- end }}

{{/* The Secret holding the admin key: the user's, or the one secret.yaml creates. */}}
{{- define "stoker.adminKeySecret" -}}
{{ .Values.adminKey.existingSecret | default (printf "%s-admin-key" (include "stoker.fullname" .)) }}
{{- end }}

{{/* Environment every process gets: the admin key, and HOME on the writable /tmp. */}}
{{- define "stoker.commonEnv" -}}
- name: STOKER_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "stoker.adminKeySecret" . }}
      key: {{ .Values.adminKey.key }}
- name: HOME
  value: /tmp
{{- end }}

{{/* Object storage settings, for the processes that move snapshots (controller, node agent). */}}
{{- define "stoker.s3Env" -}}
{{- with .Values.s3.endpointUrl }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}

{{/* Every container's security context: nothing it does not need. */}}
{{- define "stoker.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Readiness on /healthz of the container's port named "http": a pod is in its Service once it
answers. Given a dict: "https", whether the port serves HTTPS (the controller's, with TLS). */}}
{{- define "stoker.readinessProbe" -}}
readinessProbe:
  httpGet:
    path: /healthz
    port: http
    {{- if .https }}
    scheme: HTTPS
    {{- end }}
  periodSeconds: 5
  failureThreshold: 3
{{- end }}

{{/* Readiness and liveness on /healthz of the port named "http", for the processes that listen
from the start (gateways, node agents). The controller takes readiness only: controller.yaml says why. */}}
{{- define "stoker.probes" -}}
{{ include "stoker.readinessProbe" (dict "https" false) }}
livenessProbe:
  httpGet:
    path: /healthz
    port: http
  initialDelaySeconds: 10
  periodSeconds: 10
  failureThreshold: 6
{{- end }}
