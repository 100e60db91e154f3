{{/*
Names, labels and shared fragments of the vivant chart.
*/}}

{{- define "vivant.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vivant.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "vivant.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "vivant.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "operator") */}}
{{- define "vivant.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vivant.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "vivant.componentLabels" -}}
{{ include "vivant.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* "repo:tag" with the tag pinned: (dict "image" .Values.image "field" "image") */}}
{{- define "vivant.pinnedImage" -}}
{{- if or (not .image.tag) (eq (toString .image.tag) "latest") }}
{{- fail (printf "%s.tag: expected a pinned release tag, got %q (`latest` and empty tags are not allowed)" .field (toString .image.tag)) }}
{{- end }}
{{- printf "%s:%s" .image.repository (toString .image.tag) }}
{{- end }}

{{- define "vivant.image" -}}
{{- include "vivant.pinnedImage" (dict "image" .Values.image "field" "image") }}
{{- end }}

{{- define "vivant.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "vivant.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "vivant.apiServiceAccount" -}}
{{- if .Values.api.serviceAccount.create }}
{{- default (printf "%s-api" (include "vivant.fullname" .)) .Values.api.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.api.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The Secret holding the Redis URL under key `url`: the chart's own when it has the URL (redis.url or the
in-chart Redis), else redis.existingSecret. Conflicting settings fail the render with a message.
*/}}
{{- define "vivant.redisSecret" -}}
{{- $r := .Values.redis }}
{{- if and $r.url $r.internal.enabled }}
{{- fail "redis: set either redis.url (external Redis) or redis.internal.enabled (in-chart Redis), not both" }}
{{- end }}
{{- if or $r.url $r.internal.enabled }}
{{- printf "%s-redis" (include "vivant.fullname" .) }}
{{- else if $r.existingSecret }}
{{- $r.existingSecret }}
{{- else }}
{{- fail "redis: expected one of redis.url, redis.existingSecret or redis.internal.enabled=true" }}
{{- end }}
{{- end }}

{{- define "vivant.livekitSecret" -}}
{{- $l := .Values.livekit }}
{{- if or $l.apiKey $l.apiSecret }}
{{- if not (and $l.apiKey $l.apiSecret) }}
{{- fail "livekit: apiKey and apiSecret must be set together (or use livekit.existingSecret)" }}
{{- end }}
{{- printf "%s-livekit" (include "vivant.fullname" .) }}
{{- else if $l.existingSecret }}
{{- $l.existingSecret }}
{{- else }}
{{- fail "livekit: expected livekit.existingSecret or livekit.apiKey + livekit.apiSecret" }}
{{- end }}
{{- end }}

{{/* Environment shared by the operator and the API: Redis URL and LiveKit credentials from Secrets. */}}
{{- define "vivant.commonEnv" -}}
- name: VIVANT_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "vivant.redisSecret" . }}
      key: url
- name: LIVEKIT_URL
  value: {{ .Values.livekit.url | quote }}
- name: LIVEKIT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "vivant.livekitSecret" . }}
      key: api-key
- name: LIVEKIT_API_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "vivant.livekitSecret" . }}
      key: api-secret
{{- end }}
