{{- define "dropgate.labels" -}}
app.kubernetes.io/name: dropgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}
{{- define "dropgate.selector" -}}
app.kubernetes.io/name: dropgate
app.kubernetes.io/component: operator
{{- end -}}
