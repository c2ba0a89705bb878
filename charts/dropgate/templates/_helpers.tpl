{{/* The chart's name: "dropgate" unless nameOverride. */}}
{{- define "dropgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's base name, from the release name (at most 63 characters):
"<release>-dropgate", or the release name alone when it already contains the chart's
name (release "dropgate" -> "dropgate"). Every object's name starts with it.
*/}}
{{- define "dropgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "dropgate.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
"<fullname>-<suffix>", the fullname shortened so that the whole stays a valid
63-character DNS label (Service names must be one).
Usage: include "dropgate.componentName" (list . "operator")
*/}}
{{- define "dropgate.componentName" -}}
{{- $ctx := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := include "dropgate.fullname" $ctx | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base $suffix -}}
{{- end -}}

{{/*
Names of cluster-scoped objects (ClusterRole, ClusterRoleBinding, the webhook
configuration) also carry the release namespace: two releases of the same name in
two namespaces do not collide. Usage: include "dropgate.clusterName" (list . "operator")
*/}}
{{- define "dropgate.clusterName" -}}
{{- $ctx := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $name := printf "%s-%s" $ctx.Release.Namespace (include "dropgate.fullname" $ctx) -}}
{{- if $suffix -}}{{- $name = printf "%s-%s" $name $suffix -}}{{- end -}}
{{- $name | trunc 253 | trimSuffix "-" -}}
{{- end -}}

{{- define "dropgate.operatorName" -}}
{{- include "dropgate.componentName" (list . "operator") -}}
{{- end -}}

{{- define "dropgate.webhookServiceName" -}}
{{- include "dropgate.componentName" (list . "webhook") -}}
{{- end -}}

{{- define "dropgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* What selects the operator's pods: name, instance, component. */}}
{{- define "dropgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dropgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/*
Every object's labels, each key once. Usage: include "dropgate.labels" (list . "operator");
the component may be "" (objects that belong to the whole release, such as the CRD).
*/}}
{{- define "dropgate.labels" -}}
{{- $ctx := index . 0 -}}
{{- $component := index . 1 -}}
helm.sh/chart: {{ include "dropgate.chart" $ctx }}
app.kubernetes.io/name: {{ include "dropgate.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
{{- with $component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: dropgate
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
{{- end -}}

{{/* repository:tag of the operator's image; the tag defaults to the appVersion. */}}
{{- define "dropgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The sidecar's image: sidecar.image, each part defaulting to image's. */}}
{{- define "dropgate.sidecarImage" -}}
{{- $repository := default .Values.image.repository .Values.sidecar.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.sidecar.image.tag -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/* Where the operator's replicas read the webhook's certificate and key. */}}
{{- define "dropgate.webhookCertDir" -}}/etc/dropgate/webhook{{- end -}}

{{- define "dropgate.webhookTLSSecret" -}}
{{- include "dropgate.componentName" (list . "webhook-tls") -}}
{{- end -}}

{{- define "dropgate.webhookCASecret" -}}
{{- include "dropgate.componentName" (list . "webhook-ca") -}}
{{- end -}}

{{/*
The host names (and IPs) the webhook's serving certificate names, as a dict
{dns: [...], ips: [...]}: the Service's DNS names, and the host of webhook.url.
*/}}
{{- define "dropgate.webhookHosts" -}}
{{- $svc := include "dropgate.webhookServiceName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $dns := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) -}}
{{- $ips := list -}}
{{- with .Values.webhook.url -}}
{{- $host := (urlParse .).hostname -}}
{{- if regexMatch "^[0-9.]+$|:" $host -}}
{{- $ips = append $ips $host -}}
{{- else -}}
{{- $dns = append $dns $host -}}
{{- end -}}
{{- end -}}
{{- dict "dns" $dns "ips" $ips | toJson -}}
{{- end -}}

{{/*
The namespaces neither webhook is ever called for: kube-system, and the operator's
own (so that its pods can always be created, whatever failurePolicy says).
*/}}
{{- define "dropgate.webhookExcluded" -}}
- key: kubernetes.io/metadata.name
  operator: NotIn
  values: [kube-system, {{ .Release.Namespace | quote }}]
{{- end -}}

{{/* What both webhooks share. Usage: include "dropgate.webhookCommon" (list . $caBundle) */}}
{{- define "dropgate.webhookCommon" -}}
{{- $ctx := index . 0 -}}
{{- $caBundle := index . 1 -}}
{{- $svc := include "dropgate.webhookServiceName" $ctx -}}
clientConfig:
  {{- with $ctx.Values.webhook.url }}
  url: {{ . | quote }}
  {{- else }}
  service:
    name: {{ $svc }}
    namespace: {{ $ctx.Release.Namespace }}
    path: /mutate
    port: 443
  {{- end }}
  {{- with $caBundle }}
  caBundle: {{ . }}
  {{- end }}
rules:
  - operations: [CREATE]
    apiGroups: [""]
    apiVersions: [v1]
    resources: [pods]
    scope: Namespaced
admissionReviewVersions: [v1]
sideEffects: None
timeoutSeconds: {{ $ctx.Values.webhook.timeoutSeconds }}
failurePolicy: {{ $ctx.Values.webhook.failurePolicy }}
matchPolicy: Equivalent
reinvocationPolicy: IfNeeded
{{- end -}}

{{/*
The operator's ServiceAccount: serviceAccount.name, else the operator's own name.
*/}}
{{- define "dropgate.serviceAccountName" -}}
{{- default (include "dropgate.operatorName" .) .Values.serviceAccount.name -}}
{{- end -}}
