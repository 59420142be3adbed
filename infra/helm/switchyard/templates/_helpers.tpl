{{/* Labels that select one release's pods (each workload adds its app.kubernetes.io/component). */}}
{{- define "switchyard.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Every object's labels. */}}
{{- define "switchyard.labels" -}}
{{ include "switchyard.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The ServiceAccount every component runs as. */}}
{{- define "switchyard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ default .Release.Name .Values.serviceAccount.name }}
{{- else -}}
{{ default "default" .Values.serviceAccount.name }}
{{- end -}}
{{- end }}

{{/* The InferencePool's name (the HTTPRoute's backendRef names it too). */}}
{{- define "switchyard.poolName" -}}
{{ default (printf "%s-pool" .Release.Name) .Values.inferencePool.name }}
{{- end }}
