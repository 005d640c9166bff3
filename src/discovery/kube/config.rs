//! Configuration of `KubeDiscovery`: its settings, its bounds and the identity of the
//! pod it registers for.

use std::time::Duration;

use crate::config::ConfigError;
use crate::discovery::DiscoveryError;
use crate::discovery::records::DynamoRecords;

/// Where a [`KubeDiscovery`](super::KubeDiscovery) reads readiness from (Dynamo's
/// `DYN_KUBE_DISCOVERY_MODE`).
///
/// ```
/// use eventplane::discovery::KubeMode;
/// assert_eq!(KubeMode::default(), KubeMode::Pod);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KubeMode {
    /// One resource per pod, named after it; readiness from EndpointSlices
    /// (`conditions.ready` of the endpoint whose `targetRef` is the pod).
    #[default]
    Pod,
    /// One resource per container, named `{pod}-{container}` (the pod's own name for a
    /// container named `main`); readiness from Pods (`status.containerStatuses[].ready`).
    Container,
}

/// The pod (and, in container mode, the container) this process registers for: the
/// owner of its `DynamoWorkerMetadata` resource.
///
/// ```
/// use eventplane::discovery::PodIdentity;
/// let pod = PodIdentity::new("worker-0", "11111111-2222-3333-4444-555555555555", "capns");
/// assert_eq!(pod.resource_name(), "worker-0");
/// assert_eq!(pod.clone().container("engine-0").resource_name(), "worker-0-engine-0");
/// assert_eq!(pod.container("main").resource_name(), "worker-0");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodIdentity {
    pub(crate) name: String,
    pub(crate) uid: String,
    pub(crate) namespace: String,
    pub(crate) container: Option<String>,
}

impl PodIdentity {
    /// A pod by name, uid and Kubernetes namespace (pod mode).
    pub fn new(
        name: impl Into<String>,
        uid: impl Into<String>,
        namespace: impl Into<String>,
    ) -> PodIdentity {
        PodIdentity {
            name: name.into(),
            uid: uid.into(),
            namespace: namespace.into(),
            container: None,
        }
    }

    /// Registers for one container of the pod (container mode).
    pub fn container(mut self, container: impl Into<String>) -> PodIdentity {
        self.container = Some(container.into());
        self
    }

    /// The pod as Dynamo finds it: each of name, uid and namespace from
    /// `/etc/podinfo/pod_name` (`pod_uid`, `pod_namespace`: the downward API volume)
    /// when that file is there and not blank, else from `POD_NAME` (`POD_UID`,
    /// `POD_NAMESPACE`); the namespace defaults to `default`. With
    /// `DYN_KUBE_DISCOVERY_MODE=container`, the container is `CONTAINER_NAME`.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidConfig`] when the name or uid is found nowhere, or
    /// the mode is neither `pod` nor `container`, or container mode has no
    /// `CONTAINER_NAME`.
    ///
    /// ```no_run
    /// use eventplane::discovery::PodIdentity;
    /// let pod = PodIdentity::from_env()?;
    /// println!("registering for {}", pod.resource_name());
    /// # Ok::<(), eventplane::discovery::DiscoveryError>(())
    /// ```
    pub fn from_env() -> Result<PodIdentity, DiscoveryError> {
        let read = |file: &str, var: &str| {
            std::fs::read_to_string(format!("/etc/podinfo/{file}"))
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .or_else(|| std::env::var(var).ok().filter(|s| !s.trim().is_empty()))
        };
        let missing = |what: &str| {
            DiscoveryError::InvalidConfig(ConfigError::Invalid {
                field: "pod",
                reason: format!(
                    "no pod {what}: set POD_{} or /etc/podinfo",
                    what.to_uppercase()
                ),
            })
        };
        let name = read("pod_name", "POD_NAME").ok_or_else(|| missing("name"))?;
        let uid = read("pod_uid", "POD_UID").ok_or_else(|| missing("uid"))?;
        let namespace = read("pod_namespace", "POD_NAMESPACE").unwrap_or_else(|| "default".into());
        let pod = PodIdentity::new(name, uid, namespace);
        match std::env::var("DYN_KUBE_DISCOVERY_MODE").ok().as_deref() {
            None | Some("pod") => Ok(pod),
            Some("container") => match std::env::var("CONTAINER_NAME") {
                Ok(c) if !c.trim().is_empty() => Ok(pod.container(c)),
                _ => Err(DiscoveryError::InvalidConfig(ConfigError::Invalid {
                    field: "pod",
                    reason: "container mode needs CONTAINER_NAME".into(),
                })),
            },
            Some(other) => Err(DiscoveryError::InvalidConfig(ConfigError::Invalid {
                field: "pod",
                reason: format!(
                    "DYN_KUBE_DISCOVERY_MODE={:?} is neither pod nor container",
                    other.chars().take(32).collect::<String>()
                ),
            })),
        }
    }

    /// The name of the resource this identity writes: the pod's, or
    /// `{pod}-{container}` (the pod's for a container named `main`).
    pub fn resource_name(&self) -> String {
        match self.container.as_deref() {
            Some(c) if c != "main" => format!("{}-{c}", self.name),
            _ => self.name.clone(),
        }
    }

    /// The Kubernetes namespace of the pod.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The mode this identity implies.
    pub fn mode(&self) -> KubeMode {
        if self.container.is_some() {
            KubeMode::Container
        } else {
            KubeMode::Pod
        }
    }
}

/// The most bytes one list page may take by default (read before it is parsed): 32
/// resources of etcd's largest (1.5 MiB) fit with room to spare. A longer page is
/// asked for again with half as many resources.
const MAX_PAGE_BYTES: usize = 64 << 20;

/// The bounds of what one watch (or list) holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) max_resources: usize,
    pub(crate) max_channel_entries: usize,
    pub(crate) max_publishers_per_resource: usize,
    pub(crate) max_publisher_refs: usize,
    pub(crate) max_key_bytes: usize,
    pub(crate) max_value_bytes: usize,
    pub(crate) max_page_bytes: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_resources: 16_384,
            max_channel_entries: 1_024,
            max_publishers_per_resource: 256,
            max_publisher_refs: 65_536,
            max_key_bytes: 1_024,
            max_value_bytes: 64 * 1_024,
            max_page_bytes: MAX_PAGE_BYTES,
        }
    }
}

/// Settings of a [`KubeDiscovery`](super::KubeDiscovery), validated once by
/// [`KubeDiscoveryBuilder::connect`](super::KubeDiscoveryBuilder::connect).
#[derive(Clone)]
pub(crate) struct KubeConfig {
    pub(crate) client: Option<kube::Client>,
    pub(crate) namespaces: Vec<String>,
    pub(crate) mode: Option<KubeMode>,
    pub(crate) records: DynamoRecords,
    pub(crate) pod: Option<PodIdentity>,
    pub(crate) limits: Limits,
    pub(crate) page_size: u32,
    pub(crate) request_timeout: Duration,
    pub(crate) watch_open_timeout: Duration,
    pub(crate) watch_timeout: Duration,
    pub(crate) watch_buffer: usize,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
}

impl std::fmt::Debug for KubeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeConfig")
            .field("namespaces", &self.namespaces)
            .field("mode", &self.mode)
            .field("records", &self.records)
            .field("pod", &self.pod)
            .field("limits", &self.limits)
            .field("page_size", &self.page_size)
            .finish_non_exhaustive()
    }
}

impl KubeConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field, reason: &str| {
            Err(ConfigError::Invalid {
                field,
                reason: reason.to_owned(),
            })
        };
        if !(1..=500).contains(&self.page_size) {
            return invalid("page_size", "must be 1..=500");
        }
        let l = &self.limits;
        if [
            l.max_resources,
            l.max_channel_entries,
            l.max_publishers_per_resource,
            l.max_publisher_refs,
            l.max_key_bytes,
            l.max_value_bytes,
            l.max_page_bytes,
            self.watch_buffer,
        ]
        .contains(&0)
        {
            return invalid("limits", "every bound must be at least 1");
        }
        if self.watch_timeout < Duration::from_secs(1) || self.watch_timeout.subsec_nanos() != 0 {
            return invalid("watch_timeout", "whole seconds, at least 1");
        }
        if self.request_timeout.is_zero() || self.watch_open_timeout.is_zero() {
            return invalid("request_timeout", "must be positive");
        }
        if self.backoff_min.is_zero() || self.backoff_min > self.backoff_max {
            return invalid("backoff", "0 < min <= max");
        }
        if self
            .namespaces
            .iter()
            .any(|n| n.is_empty() || n.len() > 253)
        {
            return invalid("namespaces", "each 1..=253 bytes");
        }
        if let Some(pod) = &self.pod {
            if pod.name.is_empty() || pod.uid.is_empty() || pod.namespace.is_empty() {
                return invalid("pod", "name, uid and namespace must be set");
            }
        }
        Ok(())
    }

    /// The readiness mode: explicit, else the pod's.
    pub(crate) fn mode(&self) -> KubeMode {
        self.mode
            .unwrap_or_else(|| self.pod.as_ref().map_or(KubeMode::Pod, PodIdentity::mode))
    }
}
