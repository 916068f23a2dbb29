{{/* Names and labels. */}}
{{- define "emsd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "emsd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "emsd.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: daemon
{{- end -}}

{{- define "emsd.zookeeperSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: zookeeper
{{- end -}}

{{- define "emsd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* pool.size as a Kubernetes quantity: "4GiB" -> "4Gi". */}}
{{- define "emsd.poolQuantity" -}}
{{- $size := toString .Values.pool.size -}}
{{- if not (regexMatch "^[1-9][0-9]*(Mi|Gi)B$" $size) -}}
{{- fail (printf "pool.size must be a whole number of MiB or GiB like \"4GiB\" (got %q)" $size) -}}
{{- end -}}
{{- trimSuffix "B" $size -}}
{{- end -}}

{{/* The ZooKeeper connect string of the cluster. */}}
{{- define "emsd.zookeeper" -}}
{{- if .Values.cluster.zookeeper -}}
{{- .Values.cluster.zookeeper -}}
{{- else if .Values.zookeeper.enabled -}}
{{- include "emsd.fullname" . }}-zookeeper:2181
{{- else -}}
{{- fail "cluster.enabled needs ZooKeeper: set zookeeper.enabled=true or cluster.zookeeper=host:port" -}}
{{- end -}}
{{- end -}}

{{- define "emsd.secretName" -}}
{{- .Values.cluster.existingSecret | default (printf "%s-cluster" (include "emsd.fullname" .)) -}}
{{- end -}}
