//! A `DynamoWorkerMetadata` resource read (the publishers it advertises, the pod that
//! owns it) and written (the body this process server-side-applies). Pure functions.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;
use serde_json::value::RawValue;

use super::config::Limits;
use super::narrow::Resource;
pub(crate) use super::narrow::{PodRef, plausible};
use crate::discovery::records::{DynamoRecords, RecordError};
use crate::discovery::{ChannelId, Instance, Transport};

/// The custom resource's group, version, kind and plural.
pub(crate) const GROUP: &str = "nvidia.com";
pub(crate) const VERSION: &str = "v1alpha1";
pub(crate) const KIND: &str = "DynamoWorkerMetadata";
pub(crate) const PLURAL: &str = "dynamoworkermetadatas";
/// The field manager of every apply (Dynamo's).
pub(crate) const FIELD_MANAGER: &str = "dynamo-worker";
/// The one label selector on the wire, for EndpointSlices and Pods alike.
pub(crate) const DISCOVERY_LABEL: &str = "nvidia.com/dynamo-discovery-enabled=true";

/// What one resource advertises.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Advertised {
    pub(crate) owner: Option<PodRef>,
    /// Its creation timestamp: of two resources advertising one publisher id, the
    /// older keeps it.
    pub(crate) created: Option<String>,
    /// At most `Limits::max_publishers_per_resource`, unique ids.
    pub(crate) publishers: Vec<Instance>,
    /// Entries skipped as malformed or over a bound (each counted).
    pub(crate) skipped: u64,
}

/// Reads the publishers a resource advertises in `spec.data.event_channels` (their
/// workers from `event_sources`), within `limits` (entries over a bound were skipped
/// while reading it, [`narrow`](super::narrow)). A `null` or missing map is empty (a
/// real API server turns an emptied map into `null`); `endpoints` and `model_cards`
/// are not read. Entries that are malformed or over a bound are skipped and counted;
/// only a `spec.data` (or one of its two maps) that is not an object, or a version
/// that is not a positive integer, fails the whole resource.
pub(crate) fn advertised(
    resource: &Resource,
    records: &DynamoRecords,
    limits: &Limits,
) -> Result<Advertised, RecordError> {
    let incarnation = resource
        .version
        .as_deref()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|v| *v > 0)
        .ok_or_else(|| RecordError::BadValue("resourceVersion is not a positive integer".into()))?;
    let data = resource
        .data
        .as_ref()
        .map_err(|e| RecordError::BadValue(e.clone()))?;
    let mut out = Advertised::empty(resource.owner.clone());
    out.created = resource.created.clone();
    out.skipped = data.skipped;
    let mut seen = HashSet::new();
    for (key, value) in &data.channels {
        match entry(key, value, incarnation, records) {
            Ok(None) => {}
            Ok(Some(mut instance)) => {
                if !seen.insert(instance.id.clone())
                    || out.publishers.len() >= limits.max_publishers_per_resource
                {
                    out.skipped += 1;
                    continue;
                }
                if let Some(source) = data.sources.get(key) {
                    match records.parse_source(&instance.id, source.get().as_bytes()) {
                        Ok((w, recovery)) => {
                            instance = instance.with_worker(w);
                            instance.recovery = recovery;
                        }
                        Err(_) => out.skipped += 1,
                    }
                }
                out.publishers.push(instance);
            }
            Err(_) => out.skipped += 1,
        }
    }
    Ok(out)
}

impl Advertised {
    fn empty(owner: Option<PodRef>) -> Advertised {
        Advertised {
            owner,
            created: None,
            publishers: Vec::new(),
            skipped: 0,
        }
    }
}

/// One `event_channels` entry: `None` for another endpoint than the followed one.
fn entry(
    key: &str,
    value: &RawValue,
    incarnation: u64,
    records: &DynamoRecords,
) -> Result<Option<Instance>, RecordError> {
    let (id, endpoint) = match records.id_of_tail(key.as_bytes()) {
        Ok(named) => named,
        Err(RecordError::Unfollowed) => return Ok(None),
        Err(e) => return Err(e),
    };
    let transport = records.parse_value(&id, &endpoint, value.get().as_bytes())?;
    Ok(Some(Instance::new(id, transport, incarnation)))
}

/// One registration's two records, in a resource's form.
#[derive(Debug, Clone)]
pub(crate) struct Written {
    /// The key of both maps (the etcd path without `v1/event_channels/`).
    pub(crate) key: String,
    pub(crate) channel: Box<RawValue>,
    /// The `EventSource` record (Dynamo's router reads the worker there); none when
    /// the registration names no worker.
    pub(crate) source: Option<Box<RawValue>>,
}

impl Written {
    pub(crate) fn new(
        records: &DynamoRecords,
        id: &ChannelId,
        transport: &Transport,
        recovery: Option<&str>,
    ) -> Result<Written, RecordError> {
        let key = records.key(id);
        let key = key
            .strip_prefix(records.root())
            .unwrap_or(key.as_str())
            .to_owned();
        let (channel, source) = records.encode_for_resource(id, transport, recovery);
        let raw =
            |s: String| RawValue::from_string(s).map_err(|e| RecordError::BadValue(e.to_string()));
        Ok(Written {
            key,
            channel: raw(channel)?,
            source: match records.worker {
                Some(_) => Some(raw(source)?),
                None => None,
            },
        })
    }
}

/// The body of a server-side apply of this process's resource: the whole resource,
/// the four maps always present (Dynamo's shape, key for key).
#[derive(Debug, Serialize)]
pub(crate) struct ApplyBody<'a> {
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    kind: &'static str,
    metadata: ApplyMeta<'a>,
    spec: ApplySpec<'a>,
}

#[derive(Debug, Serialize)]
struct ApplyMeta<'a> {
    name: &'a str,
    #[serde(rename = "ownerReferences")]
    owner_references: [OwnerRef<'a>; 1],
}

#[derive(Debug, Serialize)]
struct OwnerRef<'a> {
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    #[serde(rename = "blockOwnerDeletion")]
    block_owner_deletion: bool,
    controller: bool,
    kind: &'static str,
    name: &'a str,
    uid: &'a str,
}

#[derive(Debug, Serialize)]
struct ApplySpec<'a> {
    data: ApplyData<'a>,
}

#[derive(Debug, Serialize)]
struct ApplyData<'a> {
    endpoints: BTreeMap<&'a str, &'a RawValue>,
    model_cards: BTreeMap<&'a str, &'a RawValue>,
    event_channels: BTreeMap<&'a str, &'a RawValue>,
    event_sources: BTreeMap<&'a str, &'a RawValue>,
}

impl<'a> ApplyBody<'a> {
    /// The resource `name`, owned by `pod` (`controller` in pod mode, not in container
    /// mode), advertising `written`.
    pub(crate) fn new(
        name: &'a str,
        pod: &'a PodRef,
        controller: bool,
        written: impl IntoIterator<Item = &'a Written>,
    ) -> ApplyBody<'a> {
        let mut data = ApplyData {
            endpoints: BTreeMap::new(),
            model_cards: BTreeMap::new(),
            event_channels: BTreeMap::new(),
            event_sources: BTreeMap::new(),
        };
        for w in written {
            data.event_channels.insert(&w.key, &w.channel);
            if let Some(source) = &w.source {
                data.event_sources.insert(&w.key, source);
            }
        }
        ApplyBody {
            api_version: "nvidia.com/v1alpha1",
            kind: KIND,
            metadata: ApplyMeta {
                name,
                owner_references: [OwnerRef {
                    api_version: "v1",
                    block_owner_deletion: false,
                    controller,
                    kind: "Pod",
                    name: &pod.name,
                    uid: &pod.uid,
                }],
            },
            spec: ApplySpec { data },
        }
    }
}
