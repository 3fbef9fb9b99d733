{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, with the chart name unless it already contains it. */}}
{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: node-agent
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
kvpool.bytes turns a Kubernetes quantity made of an integer and an optional
binary or decimal suffix ("16Gi", "500M", "1073741824") into a byte count.
Fractions and exponents are refused: sizes here are whole bytes.
*/}}
{{- define "kvpool.bytes" -}}
{{- $q := toString .value -}}
{{- if not (regexMatch "^(0|[1-9][0-9]{0,17})(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$" $q) -}}
{{- fail (printf "%s: %q is not a whole-byte quantity such as 16Gi or 500M" .name $q) -}}
{{- end -}}
{{- $digits := regexFind "^[0-9]+" $q -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 -}}
{{- $unit := get $units (trimPrefix $digits $q) -}}
{{- $b := mul (int64 $digits) $unit -}}
{{- if ne (div $b $unit) (int64 $digits) -}}
{{- fail (printf "%s: %q is too large" .name $q) -}}
{{- end -}}
{{- $b -}}
{{- end -}}

{{/* kvpool.quantity writes a byte count in the largest binary unit that divides it. */}}
{{- define "kvpool.quantity" -}}
{{- $b := int64 . -}}
{{- if and (gt $b 0) (eq (mod $b 1073741824) 0) -}}{{ div $b 1073741824 }}Gi
{{- else if and (gt $b 0) (eq (mod $b 1048576) 0) -}}{{ div $b 1048576 }}Mi
{{- else if and (gt $b 0) (eq (mod $b 1024) 0) -}}{{ div $b 1024 }}Ki
{{- else -}}{{ $b }}
{{- end -}}
{{- end -}}

{{/* Pool and headroom in bytes, checked. */}}
{{- define "kvpool.poolBytes" -}}
{{- $b := include "kvpool.bytes" (dict "name" "pool.bytes" "value" .Values.pool.bytes) | int64 -}}
{{- if le $b 0 -}}{{ fail "pool.bytes must be greater than zero" }}{{- end -}}
{{- $b -}}
{{- end -}}

{{- /* The page tables of a mapping of the whole pool of 4 KiB pages: 8 bytes
a page, rounded up (the agent's sizing.PageTableBytes). The kernel charges
them to the process that maps the pool: the agent, while it faults a chunk
in and locks it, and the keeper, which holds the lock after. With huge pages
they are 512 times fewer, left to the headroom: 0 here. */ -}}
{{- define "kvpool.pageTableBytes" -}}
{{- if .Values.pool.hugePages -}}0{{- else -}}{{- div (add (include "kvpool.poolBytes" . | int64) 511) 512 -}}{{- end -}}
{{- end -}}

{{- /* The sessions' page links: 4 bytes a host page the sessions hold, whose
size the clients choose; the agent bounds their pages to the pool's bytes /
4 KiB, at least 4 Mi pages (limits.maxPages 0), so they take at most
pool.bytes / 1024, at least 16 MiB, rounded up (the agent's
sizing.LinkBytes), huge pages or not. */ -}}
{{- define "kvpool.pageLinkBytes" -}}
{{- max (div (add (include "kvpool.poolBytes" . | int64) 1023) 1024) 16777216 -}}
{{- end -}}

{{- define "kvpool.headroomBytes" -}}
{{- include "kvpool.bytes" (dict "name" "pool.headroom" "value" .Values.pool.headroom) -}}
{{- end -}}

{{/* The spare's memory: a spare that reads the books ahead holds about what a
restore takes (the followed state and the heap warmed for the rest), which
grows with the streams and names pool.headroom bounds: half the headroom
(at the bounds the headroom sets, agent and spare together peaked 227 MiB
above the agent alone: docs/sizing.md, "Agent memory"). None without one. */}}
{{- define "kvpool.spareBytes" -}}
{{- $r := .Values.restartInPlace -}}
{{- if and (gt (int $r.max) 0) $r.spare $r.readAhead -}}
{{- div (include "kvpool.headroomBytes" . | int64) 2 -}}
{{- else -}}0{{- end -}}
{{- end -}}

{{/* Socket, device-plugin and pod-resources paths on the host. */}}
{{- define "kvpool.devicePluginDir" -}}
{{- printf "%s/device-plugins" (trimSuffix "/" .Values.paths.kubeletDir) -}}
{{- end -}}

{{- define "kvpool.podResourcesDir" -}}
{{- printf "%s/pod-resources" (trimSuffix "/" .Values.paths.kubeletDir) -}}
{{- end -}}

{{- define "kvpool.kubeletPluginsDir" -}}
{{- printf "%s/plugins" (trimSuffix "/" .Values.paths.kubeletDir) -}}
{{- end -}}

{{- define "kvpool.pluginsRegistryDir" -}}
{{- printf "%s/plugins_registry" (trimSuffix "/" .Values.paths.kubeletDir) -}}
{{- end -}}

{{/*
kvpool.keeperSocket is the keeper's socket, the same path in the keeper's and
the agent's containers (both mount keeper.socketDir at that path).
*/}}
{{- define "kvpool.keeperSocket" -}}
{{- printf "%s/keeper.sock" (trimSuffix "/" .Values.keeper.socketDir) -}}
{{- end -}}

{{/*
kvpool.keeperSelectorLabels select the keeper's pods and never the agent's
(nor does the agent's selector, or its metrics Service, select the keeper's).
*/}}
{{- define "kvpool.keeperSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}-keeper
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: keeper
{{- end -}}
