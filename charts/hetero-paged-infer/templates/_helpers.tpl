{{/*
Helpers of the hetero-paged-infer chart, after the `helm create` scaffold. Every name is prefixed with the
chart's name so that a parent chart embedding this one cannot collide with them.
*/}}

{{/* The chart name, overridable by nameOverride. */}}
{{- define "hetero-paged-infer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fully qualified app name, cut to 63 characters: some Kubernetes name fields are limited to that
(DNS-1123 labels). A release name that already contains the chart name is used as is.
*/}}
{{- define "hetero-paged-infer.fullname" -}}
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

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "hetero-paged-infer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "hetero-paged-infer.labels" -}}
helm.sh/chart: {{ include "hetero-paged-infer.chart" . }}
{{ include "hetero-paged-infer.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hetero-paged-infer
{{- end }}

{{/* Labels that select the operator pods; never change them in an upgrade (selectors are immutable). */}}
{{- define "hetero-paged-infer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hetero-paged-infer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
The selector labels as `k=v,k2=v2`, for `hpi-operator run --self-labels`: the operator's NetworkPolicies
(spec.networkPolicy) admit the pod these select, with POD_NAMESPACE, to the pods it scrapes.
*/}}
{{- define "hetero-paged-infer.selfLabels" -}}
{{- $terms := list }}
{{- range $key, $value := include "hetero-paged-infer.selectorLabels" . | fromYaml }}
{{- $terms = append $terms (printf "%s=%s" $key $value) }}
{{- end }}
{{- join "," $terms }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "hetero-paged-infer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hetero-paged-infer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image reference; the tag defaults to the chart's appVersion. */}}
{{- define "hetero-paged-infer.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The operator's metrics Service: the full name with a suffix, still within 63 characters. */}}
{{- define "hetero-paged-infer.metricsServiceName" -}}
{{- printf "%s-metrics" (include "hetero-paged-infer.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/*
The default InferenceDeployment's name: at most 52 characters (the CRD's limit, so that the operator's
children, which append a pool name, stay within 63).
*/}}
{{- define "hetero-paged-infer.defaultInferenceDeploymentName" -}}
{{- if .Values.defaultInferenceDeployment.name }}
{{- .Values.defaultInferenceDeployment.name }}
{{- else }}
{{- printf "%s-embedded" (include "hetero-paged-infer.fullname" . | trunc 43 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{/* Where the default InferenceDeployment goes: a namespace the operator watches. */}}
{{- define "hetero-paged-infer.defaultInferenceDeploymentNamespace" -}}
{{- default .Release.Namespace .Values.operator.watchNamespace }}
{{- end }}
