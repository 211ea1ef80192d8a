{{/*
Helpers shared by every template. Component templates pass a dict
(root = the top-level context, component = "router"|"prefill"|"decode"|"redis")
where a helper needs both.
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix. Kept to 48 characters so "<prefix>-prefill" and the
pod names the Deployment derives from it stay within DNS label limits.
*/}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of one component's resources: (dict "root" $ "component" "prefill"). */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .component }}
{{- end }}

{{/* Selector labels of one component; immutable once a Deployment exists. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Full label set of one component's resources. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* The pdserve image reference; the tag defaults to the chart's appVersion. */}}
{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Redis URL every role gets as --redis-url, or "" in static mode. An external
Redis wins over the in-chart one.
*/}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.externalUrl }}
{{- .Values.redis.externalUrl }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s-redis.%s.svc.%s:%v/0" (include "pdserve.fullname" .) .Release.Namespace .Values.clusterDomain .Values.redis.port }}
{{- end }}
{{- end }}

{{/*
Static address of a role's pod: the headless Service's DNS name, which
resolves to the pod IP while exactly one pod exists (see pdserve.validate).
*/}}
{{- define "pdserve.staticAddress" -}}
{{- $svc := include "pdserve.componentName" . }}
{{- $port := get (get .root.Values .component) "port" }}
{{- printf "%s.%s.svc.%s:%v" $svc .root.Release.Namespace .root.Values.clusterDomain $port }}
{{- end }}

{{/*
Refuses combinations the system cannot serve. Without Redis the router
knows each role by one static DNS name, which addresses a single pod; more
pods would be invisible to it (or, worse, picked at random by DNS, which
breaks sticky sessions and per-pod load tracking).
*/}}
{{- define "pdserve.validate" -}}
{{- if not (include "pdserve.redisUrl" .) }}
{{- range $component := list "prefill" "decode" }}
{{- $values := get $.Values $component }}
{{- if ne (int $values.replicas) 1 }}
{{- fail (printf "%s.replicas is %v, but without Redis the router addresses exactly 1 %s pod: set redis.enabled=true (or redis.externalUrl) to run more" $component $values.replicas $component) }}
{{- end }}
{{- if $values.autoscaling.enabled }}
{{- fail (printf "%s.autoscaling.enabled needs Redis, where pods register themselves: set redis.enabled=true (or redis.externalUrl)" $component) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.source is pvc but model.pvc.claimName is empty: name an existing PersistentVolumeClaim" }}
{{- end }}
{{- if and .Values.tls.router.enabled (not .Values.tls.router.secretName) }}
{{- fail "tls.router.enabled needs tls.router.secretName: a Secret with tls.crt and tls.key" }}
{{- end }}
{{- if and (include "pdserve.podTokenSecretName" .) (not .Values.tls.pods.enabled) }}
{{- fail "podToken needs tls.pods.enabled: the token is only sent over TLS" }}
{{- end }}
{{- if and .Values.router.apiKeys.existingSecret (include "pdserve.apiKeySecretName" .) }}
{{- fail "router.apiKeys and router.apiKey are exclusive: put the one key into the keys file as `default <key>`" }}
{{- end }}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) }}
{{- fail "model.source is hostPath but model.hostPath.path is empty: name a directory on the nodes" }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the router's API key, or "" when there is none. */}}
{{- define "pdserve.apiKeySecretName" -}}
{{- if .Values.router.apiKey.existingSecret }}
{{- .Values.router.apiKey.existingSecret }}
{{- else if .Values.router.apiKey.value }}
{{- printf "%s-api-key" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations: (dict "root" $ "port" 9101 "https" false). */}}
{{- define "pdserve.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- if .https }}
prometheus.io/scheme: https
{{- end }}
{{- end }}
{{- end }}

{{/* The model directory every role passes as --model. */}}
{{- define "pdserve.modelDir" -}}
{{- printf "/models/%s" .Values.model.dir }}
{{- end }}

{{/*
Init container writing the demo model into the models emptyDir: the real
SmolLM2-135M-Instruct converted from the GGUF file the image ships, or a
built-in random-weight checkpoint (tiny, base).
Only rendered for model.source=demo; the main containers mount it read-only.
*/}}
{{- define "pdserve.modelInitContainers" -}}
{{- if eq .Values.model.source "demo" -}}
initContainers:
  - name: make-model
    image: {{ include "pdserve.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["pdserve"]
    args:
      - "make-model"
      - {{ include "pdserve.modelDir" . | quote }}
      {{- if has .Values.model.demo.model (list "tiny" "base") }}
      - "--size={{ .Values.model.demo.model }}"
      {{- else }}
      - "--from-gguf={{ .Values.model.demo.model }}"
      {{- end }}
    env:
      - name: HOME
        value: /tmp
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    resources:
      {{- toYaml .Values.model.demo.resources | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: /models
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end }}

{{/*
Volumes of every pdserve pod: the model source, a writable /tmp, and the
Secrets of docs/deploy.md's Security section (see pdserve.volumeMounts):
(dict "root" $ "component" "router").
*/}}
{{- define "pdserve.volumes" -}}
{{- $v := .root.Values }}
volumes:
  - name: models
    {{- if eq $v.model.source "pvc" }}
    persistentVolumeClaim:
      claimName: {{ $v.model.pvc.claimName }}
      readOnly: true
    {{- else if eq $v.model.source "hostPath" }}
    hostPath:
      path: {{ $v.model.hostPath.path }}
      type: Directory
    {{- else }}
    emptyDir: {}
    {{- end }}
  - name: tmp
    emptyDir: {}
  {{- if and (eq .component "router") $v.tls.router.enabled }}
  - name: router-tls
    secret:
      secretName: {{ $v.tls.router.secretName }}
  {{- end }}
  {{- if and (eq .component "router") $v.router.apiKeys.existingSecret }}
  # mounted whole (no subPath), so an updated Secret reaches the file
  - name: api-keys
    secret:
      secretName: {{ $v.router.apiKeys.existingSecret }}
  {{- end }}
  {{- if $v.tls.pods.enabled }}
  - name: pod-tls
    secret:
      secretName: {{ include "pdserve.podTlsSecretName" .root }}
  {{- end }}
  {{- with include "pdserve.podTokenSecretName" .root }}
  - name: pod-token
    secret:
      secretName: {{ . }}
  {{- end }}
  {{- with include "pdserve.shmSize" . }}
  # Tensor-parallel ranks exchange through shared memory (NCCL, gloo); a
  # container's default /dev/shm is 64 MB.
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ . }}
  {{- end }}
{{- end }}

{{/*
The size of a prefill or decode pod's memory-backed /dev/shm: its shmSize
when tensorParallelSize > 1, else empty (no mount). (dict "root" $ "component" "decode")
*/}}
{{- define "pdserve.shmSize" -}}
{{- if eq .component "prefill" }}
{{- if gt (int .root.Values.prefill.tensorParallelSize) 1 }}{{ .root.Values.prefill.shmSize }}{{ end }}
{{- else if eq .component "decode" }}
{{- if gt (int .root.Values.decode.tensorParallelSize) 1 }}{{ .root.Values.decode.shmSize }}{{ end }}
{{- end }}
{{- end }}

{{/*
A prefill or decode container's resources: the role's `resources`, and with
`gpu: true` one nvidia.com/gpu per tensor-parallel rank in limits (and
requests, which Kubernetes requires equal for extended resources).
(dict "resources" $d.resources "gpu" $d.gpu "ranks" $d.tensorParallelSize)
*/}}
{{- define "pdserve.roleResources" -}}
{{- $resources := deepCopy .resources }}
{{- if .gpu }}
{{- $gpus := dict "nvidia.com/gpu" (int .ranks) }}
{{- $_ := set $resources "limits" (merge $gpus (default dict $resources.limits)) }}
{{- $_ := set $resources "requests" (merge (deepCopy $gpus) (default dict $resources.requests)) }}
{{- end }}
resources:
  {{- toYaml $resources | nindent 2 }}
{{- end }}

{{/*
Mounts of every pdserve main container: models read-only, /tmp writable,
and the security Secrets read-only: /etc/pdserve/router-tls (the router's
listeners), /etc/pdserve/pod-tls (pod gRPC, for pods and the router alike),
/etc/pdserve/pod-token. (dict "root" $ "component" "router")
*/}}
{{- define "pdserve.volumeMounts" -}}
{{- $v := .root.Values }}
volumeMounts:
  - name: models
    mountPath: /models
    readOnly: true
  - name: tmp
    mountPath: /tmp
  {{- if and (eq .component "router") $v.tls.router.enabled }}
  - name: router-tls
    mountPath: /etc/pdserve/router-tls
    readOnly: true
  {{- end }}
  {{- if and (eq .component "router") $v.router.apiKeys.existingSecret }}
  - name: api-keys
    mountPath: /etc/pdserve/api-keys
    readOnly: true
  {{- end }}
  {{- if $v.tls.pods.enabled }}
  - name: pod-tls
    mountPath: /etc/pdserve/pod-tls
    readOnly: true
  {{- end }}
  {{- if include "pdserve.podTokenSecretName" .root }}
  - name: pod-token
    mountPath: /etc/pdserve/pod-token
    readOnly: true
  {{- end }}
  {{- if include "pdserve.shmSize" . }}
  - name: dshm
    mountPath: /dev/shm
  {{- end }}
{{- end }}

{{/*
Name of the Secret holding pod gRPC's tls.crt, tls.key and ca.crt (with
tls.pods.enabled): tls.pods.secretName, or the one the chart generates.
*/}}
{{- define "pdserve.podTlsSecretName" -}}
{{- default (printf "%s-pod-tls" (include "pdserve.fullname" .)) .Values.tls.pods.secretName }}
{{- end }}

{{/* "true" when the chart generates the pod TLS Secret: pod TLS on, no Secret named. */}}
{{- define "pdserve.generatesPodTls" -}}
{{- if and .Values.tls.pods.enabled (not .Values.tls.pods.secretName) }}true{{ end }}
{{- end }}

{{/*
"true" when the chart generates the pod token: pod TLS without client
certificates (clientAuth=false) would otherwise authenticate no caller.
*/}}
{{- define "pdserve.generatesPodToken" -}}
{{- if and .Values.tls.pods.enabled (not .Values.tls.pods.clientAuth) (not .Values.podToken.value) (not .Values.podToken.existingSecret) }}true{{ end }}
{{- end }}

{{/* Name of the Secret holding the pod token, or "" when there is none. */}}
{{- define "pdserve.podTokenSecretName" -}}
{{- if .Values.podToken.existingSecret }}
{{- .Values.podToken.existingSecret }}
{{- else if or .Values.podToken.value (include "pdserve.generatesPodToken" .) }}
{{- printf "%s-pod-token" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{/*
What the chart's own security Secrets hold when the user names none
(docs/deploy.md, Security), made once per render and kept in
.Values (key "_generated"), so every template that needs it (the Secrets and the
Deployments' checksums) sees the same bytes: "podTls" (base64 ca.crt, tls.crt,
tls.key: a self-signed CA and one certificate for tls.pods.serverName with
server and client usage, 10 years) and "podToken" (base64, 48 random
characters). An existing Secret of the same name (`lookup`, i.e. on helm
upgrade) is reused, so upgrades keep them and restart nothing; a certificate
made for another serverName is not. `helm template` and --dry-run cannot look
up: each of their renders generates anew.
*/}}
{{- define "pdserve.generated" -}}
{{- if not (hasKey .Values "_generated") }}
{{- $generated := dict }}
{{- if include "pdserve.generatesPodTls" . }}
{{- $serverName := .Values.tls.pods.serverName }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "pdserve.podTlsSecretName" .) }}
{{- $data := $existing.data | default dict }}
{{- if and (eq (dig "metadata" "annotations" "pdserve.io/server-name" "" $existing) $serverName) (hasKey $data "ca.crt") (hasKey $data "tls.crt") (hasKey $data "tls.key") }}
{{- $_ := set $generated "podTls" (pick $data "ca.crt" "tls.crt" "tls.key") }}
{{- else }}
{{- $ca := genCA (printf "%s pod CA" (include "pdserve.fullname" .)) 3650 }}
{{- $cert := genSignedCert $serverName nil (list $serverName) 3650 $ca }}
{{- $_ := set $generated "podTls" (dict "ca.crt" ($ca.Cert | b64enc) "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc)) }}
{{- end }}
{{- end }}
{{- if include "pdserve.generatesPodToken" . }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "pdserve.podTokenSecretName" .) }}
{{- $data := $existing.data | default dict }}
{{- $_ := set $generated "podToken" (get $data .Values.podToken.secretKey | default (randAlphaNum 48 | b64enc)) }}
{{- end }}
{{- $_ := set .Values "_generated" $generated }}
{{- end }}
{{- end }}

{{/*
Restart pods when a pod token or certificate the chart writes changes: the
files are read once, at start. (A Secret the user names is theirs to roll.)
*/}}
{{- define "pdserve.securityChecksums" -}}
{{- include "pdserve.generated" . }}
{{- $generated := get .Values "_generated" }}
{{- if and .Values.podToken.value (not .Values.podToken.existingSecret) }}
checksum/pod-token: {{ .Values.podToken.value | sha256sum }}
{{- else if hasKey $generated "podToken" }}
checksum/pod-token: {{ get $generated "podToken" | sha256sum }}
{{- end }}
{{- with get $generated "podTls" }}
checksum/pod-tls: {{ toJson . | sha256sum }}
{{- end }}
{{- end }}

{{/*
The port kubelet's gRPC probes target on a pod: its gRPC port, or with pod
TLS the plaintext health-only port (kubelet's probes cannot speak TLS):
(dict "root" $ "component" "prefill").
*/}}
{{- define "pdserve.probePort" -}}
{{- if .root.Values.tls.pods.enabled }}
{{- .root.Values.tls.pods.healthPort }}
{{- else }}
{{- get (get .root.Values .component) "port" }}
{{- end }}
{{- end }}

{{/*
Env of every pdserve main container. HOME=/tmp because the root filesystem
is read-only; POD_IP feeds --advertise-host through $(POD_IP) expansion.
*/}}
{{- define "pdserve.env" -}}
- name: HOME
  value: /tmp
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- with .Values.tracing }}
{{- if .otlpEndpoint }}
# OpenTelemetry traces (tracing.*, docs/tracing.md): every role reads these
- name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  value: {{ .otlpEndpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .sampleRatio | quote }}
{{- end }}
{{- end }}
{{- end }}
