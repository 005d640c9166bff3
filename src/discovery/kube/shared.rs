//! What every task of one `KubeDiscovery` shares: the client, the settings, the
//! counters, and the paged reads that build a joined view.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::core::Request;
use tracing::warn;

use super::config::{KubeConfig, KubeMode};
use super::error::{KubeRequestError, MAX_RETRY_AFTER, is_gone, retry_after, within};
use super::join::{Change, Join, Ns, Seen};
use super::narrow;
use super::resource::{self, DISCOVERY_LABEL, GROUP, KIND, PLURAL, VERSION, plausible};
use crate::discovery::backlog::WatchCounters;
use crate::discovery::{DiscoveryError, Instance};
use crate::net::{Backoff, RateLimitedWarn};

/// Attempts at a paged list before giving up (each failure a continue token that
/// expired part-way, 410, or a refusal that named its `Retry-After`).
const LIST_ATTEMPTS: usize = 3;

pub(crate) struct Shared {
    pub(crate) client: kube::Client,
    pub(crate) config: KubeConfig,
    /// The followed namespaces (a [`Ns`] indexes this list).
    pub(crate) namespaces: Vec<String>,
    pub(crate) mode: KubeMode,
    pub(crate) counters: Counters,
    pub(crate) warn: RateLimitedWarn,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) watch: Arc<WatchCounters>,
    pub(crate) registrations: AtomicUsize,
    pub(crate) malformed: AtomicU64,
    pub(crate) reconnects: AtomicU64,
}

/// Which kind of object a list or watch reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `DynamoWorkerMetadata` resources.
    Resources,
    /// EndpointSlices (pod mode) or Pods (container mode).
    Readiness,
}

/// One object read from a list or a watch, as the join takes it.
#[derive(Debug)]
pub(crate) enum Object {
    Resource(Box<narrow::Resource>),
    Slice(Box<EndpointSlice>),
    Pod(Box<Pod>),
}

impl Object {
    pub(crate) fn name(&self) -> Option<&str> {
        match self {
            Object::Resource(o) => o.name.as_deref(),
            Object::Slice(o) => o.metadata.name.as_deref(),
            Object::Pod(o) => o.metadata.name.as_deref(),
        }
    }

    pub(crate) fn version(&self) -> Option<&str> {
        match self {
            Object::Resource(o) => o.version.as_deref(),
            Object::Slice(o) => o.metadata.resource_version.as_deref(),
            Object::Pod(o) => o.metadata.resource_version.as_deref(),
        }
    }
}

/// Whether a list failed because its page was over `max_page_bytes`.
fn page_too_long(e: &DiscoveryError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(KubeRequestError::Failed { source: k, .. }) =
            err.downcast_ref::<KubeRequestError>()
        {
            return matches!(k, kube::Error::ReadEvents(io) if narrow::is_too_long(io));
        }
        source = err.source();
    }
    false
}

impl Shared {
    pub(crate) fn api_resource() -> ApiResource {
        ApiResource {
            group: GROUP.to_owned(),
            version: VERSION.to_owned(),
            api_version: format!("{GROUP}/{VERSION}"),
            kind: KIND.to_owned(),
            plural: PLURAL.to_owned(),
        }
    }

    pub(crate) fn resources(&self, ns: Ns) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            self.namespace(ns),
            &Shared::api_resource(),
        )
    }

    /// One list page of resources, read narrowly ([`narrow`]): at most
    /// `max_page_bytes` read, then split into items, each read on its own.
    async fn resource_page(
        &self,
        ns: Ns,
        params: &ListParams,
    ) -> Result<narrow::Page, kube::Error> {
        let request = Request::new(self.resources(ns).resource_url())
            .list(params)
            .map_err(kube::Error::BuildRequest)?;
        let body = super::capped::send(&self.client, request).await?;
        let text = narrow::read_capped(body, self.config.limits.max_page_bytes)
            .await
            .map_err(kube::Error::ReadEvents)?;
        let max_items = params.limit.map_or(usize::MAX, |l| l as usize);
        narrow::page(&text, max_items, &self.config.limits).map_err(kube::Error::SerdeError)
    }

    pub(crate) fn namespace(&self, ns: Ns) -> &str {
        self.namespaces.get(ns).map_or("", String::as_str)
    }

    pub(crate) fn backoff(&self) -> Backoff {
        Backoff::checked(self.config.backoff_min, self.config.backoff_max)
    }

    /// Applies one object (added or modified; `deleted` for a deletion) to `join`.
    pub(crate) fn apply(
        &self,
        join: &mut Join,
        ns: Ns,
        object: &Object,
        deleted: bool,
    ) -> Vec<Change> {
        let Some(name) = object.name() else {
            self.skipped(1, "an object without a name");
            return Vec::new();
        };
        let before = join.skipped;
        let changes = match (object, deleted) {
            (Object::Resource(_), true) => join.delete_resource(ns, name),
            (Object::Resource(o), false) => {
                let advertised = resource::advertised(o, &self.config.records, &self.config.limits);
                join.upsert_resource(ns, name, advertised)
            }
            (_, true) => join.set_readiness(ns, name, None),
            (Object::Slice(s), false) => {
                let seen = slice_ready(s, self.config.limits.max_channel_entries);
                join.set_readiness(ns, name, Some(seen))
            }
            (Object::Pod(p), false) => {
                let seen = pod_ready(p, self.config.limits.max_channel_entries);
                join.set_readiness(ns, name, Some(seen))
            }
        };
        let skipped = join.skipped - before;
        if skipped > 0 {
            self.skipped(skipped, name);
        }
        changes
    }

    /// Counts and logs (rate-limited) skipped resources or entries.
    pub(crate) fn skipped(&self, n: u64, resource: &str) {
        self.counters.malformed.fetch_add(n, Ordering::Relaxed);
        if let Some(suppressed) = self.warn.check("malformed", std::time::Instant::now()) {
            warn!(
                resource = %resource.chars().take(253).collect::<String>(),
                skipped = n,
                suppressed,
                "skipping malformed or over-bound DynamoWorkerMetadata entries"
            );
        }
    }

    /// One page of readiness objects of type `K` in `namespace`, read to
    /// `max_page_bytes` ([`capped::list`](super::capped::list)).
    async fn readiness_page<K>(
        &self,
        namespace: &str,
        params: &ListParams,
    ) -> Result<kube::api::ObjectList<K>, kube::Error>
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + serde::de::DeserializeOwned
            + Clone,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), namespace);
        let max_bytes = self.config.limits.max_page_bytes;
        super::capped::list(&self.client, api.resource_url(), params, max_bytes).await
    }

    /// Lists `kind` in namespace `ns` into `join`, page by page (one raw page held
    /// at a time); returns the list's resourceVersion.
    async fn list_pages(
        &self,
        join: &mut Join,
        ns: Ns,
        kind: Kind,
    ) -> Result<String, DiscoveryError> {
        let namespace = self.namespace(ns).to_owned();
        let timeout = self.config.request_timeout;
        let mut params = ListParams::default().limit(self.config.page_size);
        if kind == Kind::Readiness {
            params = params.labels(DISCOVERY_LABEL);
        }
        // A list holds at most `max_resources` objects that count: more pages than
        // that (a server answering `continue` for ever) fail it.
        let max_pages = self.config.limits.max_resources.saturating_add(16);
        let mut pages = 0usize;
        loop {
            let (objects, meta) = match (kind, self.mode) {
                (Kind::Resources, _) => {
                    let page =
                        match within("list", &namespace, timeout, self.resource_page(ns, &params))
                            .await
                        {
                            // A page over its bound (large resources): ask for half as
                            // many, down to one at a time.
                            Err(e) if page_too_long(&e) && params.limit.is_some_and(|l| l > 1) => {
                                let half = params.limit.unwrap_or(2) / 2;
                                params = params.limit(half);
                                continue;
                            }
                            other => other?,
                        };
                    let meta = kube::api::ListMeta {
                        continue_: page.continue_token,
                        resource_version: page.version,
                        ..Default::default()
                    };
                    (
                        page.items
                            .into_iter()
                            .map(|o| Object::Resource(Box::new(o)))
                            .collect::<Vec<_>>(),
                        meta,
                    )
                }
                (Kind::Readiness, KubeMode::Pod) => {
                    let page = within(
                        "list",
                        &namespace,
                        timeout,
                        self.readiness_page::<EndpointSlice>(&namespace, &params),
                    )
                    .await?;
                    let items = page.items.into_iter();
                    (
                        items.map(|o| Object::Slice(Box::new(o))).collect(),
                        page.metadata,
                    )
                }
                (Kind::Readiness, _) => {
                    let page = within(
                        "list",
                        &namespace,
                        timeout,
                        self.readiness_page::<Pod>(&namespace, &params),
                    )
                    .await?;
                    let items = page.items.into_iter();
                    (
                        items.map(|o| Object::Pod(Box::new(o))).collect(),
                        page.metadata,
                    )
                }
            };
            for object in &objects {
                self.apply(join, ns, object, false);
            }
            drop(objects);
            pages += 1;
            match meta.continue_.filter(|c| !c.is_empty()) {
                Some(_) if pages >= max_pages => {
                    return Err(DiscoveryError::Unavailable(
                        format!(
                            "kubernetes list of more than {max_pages} pages (namespace {namespace})"
                        )
                        .into(),
                    ));
                }
                Some(token) => params = params.continue_token(&token),
                None => return Ok(meta.resource_version.unwrap_or_default()),
            }
        }
    }

    /// A joined view of every followed namespace, read now; with the version of each
    /// (namespace, kind) list, for the watches that follow it.
    pub(crate) async fn read_all(&self) -> Result<(Join, Vec<(Ns, Kind, String)>), DiscoveryError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.read_once().await {
                // A continue token gone part-way (410): read everything again, afresh.
                Err(e) if is_gone(&e) && attempt < LIST_ATTEMPTS => continue,
                // A 429 or 5xx that said when to ask again (API Priority and Fairness,
                // a lagging replica): asked again then, at most MAX_RETRY_AFTER later.
                Err(e) if attempt < LIST_ATTEMPTS => match retry_after(&e) {
                    Some(after) => {
                        tracing::debug!(error = %crate::net::ErrorChain(&e), ?after, "kubernetes list refused; asking again after its Retry-After");
                        tokio::time::sleep(after.min(MAX_RETRY_AFTER)).await;
                    }
                    None => return Err(e),
                },
                other => return other,
            }
        }
    }

    async fn read_once(&self) -> Result<(Join, Vec<(Ns, Kind, String)>), DiscoveryError> {
        let mut join = Join::new(self.config.limits);
        let mut versions = Vec::with_capacity(self.namespaces.len() * 2);
        for ns in 0..self.namespaces.len() {
            for kind in [Kind::Readiness, Kind::Resources] {
                let version = self.list_pages(&mut join, ns, kind).await?;
                versions.push((ns, kind, version));
            }
        }
        Ok((join, versions))
    }

    /// The instances of `join` a query matches.
    pub(crate) fn matching(join: &Join, query: &crate::discovery::Query) -> Vec<Instance> {
        let mut view = join.view();
        view.retain(|i| query.matches(&i.id));
        view
    }
}

/// The ready contributions of an EndpointSlice (at most `max`): endpoints with
/// `conditions.ready` true and a `targetRef` with a name and a uid (within bounds).
/// A `ready` that is null or absent counts as not ready, as Dynamo 1.6.1's router
/// counts it (the API says to read nil as ready; the view follows Dynamo's, so both
/// routers see the same workers).
pub(crate) fn slice_ready(slice: &EndpointSlice, max: usize) -> Vec<Seen> {
    slice
        .endpoints
        .iter()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .filter_map(|e| {
            let target = e.target_ref.as_ref()?;
            let (name, uid) = (target.name.as_ref()?, target.uid.as_ref()?);
            plausible(name, uid).then(|| Seen {
                name: name.clone(),
                uid: uid.clone(),
            })
        })
        .take(max)
        .collect()
}

/// The ready contributions of a Pod: one per ready container, naming the resource
/// `{pod}-{container}` (the pod's own name for a container named `main`).
pub(crate) fn pod_ready(pod: &Pod, max: usize) -> Vec<Seen> {
    let (Some(name), Some(uid)) = (pod.metadata.name.as_ref(), pod.metadata.uid.as_ref()) else {
        return Vec::new();
    };
    if !plausible(name, uid) {
        return Vec::new();
    }
    pod.status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .filter(|c| c.ready)
        .map(|c| Seen {
            name: if c.name == "main" {
                name.clone()
            } else {
                format!("{name}-{}", c.name)
            },
            uid: uid.clone(),
        })
        .take(max)
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    /// An EndpointSlice of one endpoint for pod `w` (uid `u`) with `conditions`
    /// (`None`: the field left out).
    fn slice(conditions: Option<serde_json::Value>) -> EndpointSlice {
        let mut endpoint = serde_json::json!({"addresses": ["10.0.0.1"],
            "targetRef": {"kind": "Pod", "name": "w", "uid": "u"}});
        if let Some(c) = conditions {
            endpoint["conditions"] = c;
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "s"}, "addressType": "IPv4", "endpoints": [endpoint]
        }))
        .unwrap()
    }

    /// Only `ready: true` is ready: nil, absent and false are not (Dynamo 1.6.1's
    /// join; `serving` is not read).
    #[test]
    fn a_slice_endpoint_is_ready_only_when_ready_is_true() {
        let seen = vec![Seen {
            name: "w".into(),
            uid: "u".into(),
        }];
        assert_eq!(
            slice_ready(&slice(Some(serde_json::json!({"ready": true}))), 8),
            seen
        );
        for ready in [
            Some(serde_json::json!({"ready": null, "serving": true})),
            Some(serde_json::json!({})),
            Some(serde_json::Value::Null),
            Some(serde_json::json!({"ready": false, "serving": true})),
            None,
        ] {
            assert!(
                slice_ready(&slice(ready.clone()), 8).is_empty(),
                "{ready:?}"
            );
        }
    }
}
