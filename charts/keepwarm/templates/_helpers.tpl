{{- define "keepwarm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "keepwarm.labels" -}}
app.kubernetes.io/name: keepwarm-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "keepwarm.selectorLabels" -}}
app.kubernetes.io/name: keepwarm-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "keepwarm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "keepwarm.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "keepwarm.agentNamespace" -}}
{{- default .Release.Namespace .Values.operator.agentNamespace -}}
{{- end -}}
