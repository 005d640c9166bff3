//! `DynamoWorkerMetadata` resources read narrowly: only the fields this crate uses are
//! kept, everything else is skipped by serde_json's skipping reader (no allocation, no
//! depth: a resource nested a thousand levels deep in fields we do not read costs its
//! text and nothing more). A list page is split into its items before any is parsed,
//! so a bad item is one malformed resource, never a failed page; the bytes of a page
//! and of a watch line are bounded before they are parsed.
//!
//! What one resource costs, at most: its entries beyond `max_channel_entries`, its
//! keys over `max_key_bytes` and its values over `max_value_bytes` are skipped while
//! reading (counted), so a parsed resource holds at most `2 × max_channel_entries`
//! keys and values (`event_channels` and `event_sources`) within those bounds, besides
//! its name, version and owner.

use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;

use futures_util::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::config::Limits;

/// The most bytes one list page may take (read before it is parsed): 32 resources of
/// etcd's largest (1.5 MiB) fit with room to spare. A longer page fails the list.
pub(crate) const MAX_PAGE_BYTES: usize = 64 << 20;
/// The most bytes one watch event may take (one resource, at most 1.5 MiB in etcd,
/// with its envelope). A longer line ends the watch, which is opened again.
pub(crate) const MAX_WATCH_LINE_BYTES: usize = 4 << 20;

/// The pod a resource belongs to: its `ownerReferences` entry of kind `Pod`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct PodRef {
    pub(crate) name: String,
    pub(crate) uid: String,
}

/// Longest object name Kubernetes allows (a DNS subdomain).
pub(crate) const MAX_NAME_BYTES: usize = 253;
/// Longest uid kept (a UUID is 36 bytes).
pub(crate) const MAX_UID_BYTES: usize = 128;

/// Whether a pod name and uid are within what Kubernetes writes (and non-empty).
pub(crate) fn plausible(name: &str, uid: &str) -> bool {
    (1..=MAX_NAME_BYTES).contains(&name.len()) && (1..=MAX_UID_BYTES).contains(&uid.len())
}

/// One resource, as far as this crate reads it.
#[derive(Debug)]
pub(crate) struct Resource {
    pub(crate) name: Option<String>,
    pub(crate) version: Option<String>,
    pub(crate) owner: Option<PodRef>,
    /// `spec.data`'s two maps, or why they could not be read (the resource is then
    /// malformed: it advertises nothing).
    pub(crate) data: Result<Data, String>,
}

/// `spec.data`'s `event_channels` and `event_sources`, within the limits.
#[derive(Debug, Default)]
pub(crate) struct Data {
    pub(crate) channels: BTreeMap<String, Box<RawValue>>,
    pub(crate) sources: BTreeMap<String, Box<RawValue>>,
    /// Entries skipped while reading (over a bound).
    pub(crate) skipped: u64,
}

/// The metadata fields read (the rest, `managedFields` included, skipped).
#[derive(Deserialize, Default)]
struct Meta {
    name: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
    #[serde(rename = "ownerReferences")]
    owner_references: Option<Vec<OwnerReference>>,
}

#[derive(Deserialize)]
struct OwnerReference {
    kind: String,
    name: String,
    uid: String,
}

impl Meta {
    fn owner(&self) -> Option<PodRef> {
        self.owner_references.as_ref()?.iter().find_map(|o| {
            (o.kind == "Pod" && plausible(&o.name, &o.uid)).then(|| PodRef {
                name: o.name.clone(),
                uid: o.uid.clone(),
            })
        })
    }
}

/// An object with only its metadata read: what a resource that does not parse still
/// tells (its name and version, so that it is withdrawn rather than kept).
#[derive(Deserialize)]
struct OnlyMeta {
    #[serde(default)]
    metadata: Meta,
}

/// Reads one resource from its JSON text. Never fails: a resource whose data does
/// not read carries why; one whose metadata does not read either has no name.
pub(crate) fn resource(text: &str, limits: &Limits) -> Resource {
    let mut de = serde_json::Deserializer::from_str(text);
    match ResourceSeed(limits).deserialize(&mut de) {
        Ok(r) => r,
        Err(e) => {
            let meta = serde_json::from_str::<OnlyMeta>(text)
                .map(|o| o.metadata)
                .unwrap_or_default();
            Resource {
                owner: meta.owner(),
                name: meta.name,
                version: meta.resource_version,
                data: Err(e.to_string()),
            }
        }
    }
}

/// A list page's items (each resource read on its own) and its `continue` token and
/// version.
pub(crate) struct Page {
    pub(crate) items: Vec<Resource>,
    pub(crate) continue_token: Option<String>,
    pub(crate) version: Option<String>,
}

#[derive(Deserialize)]
struct RawPage<'a> {
    #[serde(borrow, default)]
    items: Option<Vec<&'a RawValue>>,
    #[serde(default)]
    metadata: ListMeta,
}

#[derive(Deserialize, Default)]
struct ListMeta {
    #[serde(rename = "continue")]
    continue_token: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
}

/// Reads a list page: split into items first (a `null` list is empty), then each
/// read on its own.
pub(crate) fn page(text: &str, limits: &Limits) -> Result<Page, serde_json::Error> {
    let raw: RawPage<'_> = serde_json::from_str(text)?;
    Ok(Page {
        items: raw
            .items
            .unwrap_or_default()
            .into_iter()
            .map(|item| resource(item.get(), limits))
            .collect(),
        continue_token: raw.metadata.continue_token.filter(|c| !c.is_empty()),
        version: raw.metadata.resource_version,
    })
}

/// One watch event's line: its type and its object (kept as text).
#[derive(Deserialize)]
pub(crate) struct Line<'a> {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    #[serde(borrow)]
    pub(crate) object: &'a RawValue,
}

/// The fields of a `Status` (a watch's `ERROR` event) read.
#[derive(Deserialize)]
pub(crate) struct Status {
    #[serde(default)]
    pub(crate) code: u16,
    #[serde(default)]
    pub(crate) message: String,
}

/// An object's `metadata.resourceVersion` (a bookmark's), if it reads.
pub(crate) fn version_of(text: &str) -> Option<String> {
    serde_json::from_str::<OnlyMeta>(text)
        .ok()?
        .metadata
        .resource_version
}

/// Reads a whole body, failing past `max` bytes.
pub(crate) async fn read_capped(
    mut body: Pin<Box<dyn AsyncBufRead + Send>>,
    max: usize,
) -> std::io::Result<String> {
    let mut out = Vec::new();
    let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
    (&mut body).take(limit).read_to_end(&mut out).await?;
    if out.len() > max {
        return Err(too_long("a list page", max));
    }
    String::from_utf8(out).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Reads one line (without its newline) into `line`, failing past `max` bytes without
/// holding more than that; `false` at the end of the body.
pub(crate) async fn read_line_capped(
    body: &mut Pin<Box<dyn AsyncBufRead + Send>>,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<bool> {
    line.clear();
    loop {
        let buf = body.fill_buf().await?;
        if buf.is_empty() {
            return Ok(!line.is_empty());
        }
        let (take, done) = match buf.iter().position(|b| *b == b'\n') {
            Some(at) => (at, true),
            None => (buf.len(), false),
        };
        if line.len() + take > max {
            return Err(too_long("a watch event", max));
        }
        line.extend_from_slice(buf.get(..take).unwrap_or_default());
        body.as_mut().consume(take + usize::from(done));
        if done {
            return Ok(true);
        }
    }
}

fn too_long(what: &str, max: usize) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("{what} longer than {max} bytes"),
    )
}

/// Reads a resource: `metadata` and `spec.data`, nothing else.
struct ResourceSeed<'l>(&'l Limits);

impl<'de> DeserializeSeed<'de> for ResourceSeed<'_> {
    type Value = Resource;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Resource, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ResourceSeed<'_> {
    type Value = Resource;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a DynamoWorkerMetadata object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Resource, A::Error> {
        let mut meta = Meta::default();
        let mut data = Ok(Data::default());
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "metadata" => meta = map.next_value()?,
                "spec" => data = map.next_value_seed(Within(self.0, Level::Spec))?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Resource {
            owner: meta.owner(),
            name: meta.name,
            version: meta.resource_version,
            data,
        })
    }
}

/// Where in the resource a [`Within`] reads.
#[derive(Clone, Copy)]
enum Level {
    /// `spec`: an object with `data`, or null.
    Spec,
    /// `spec.data`: an object with the two maps, or null.
    Data,
}

/// Reads `spec` or `spec.data`: `Ok` with what it found (empty when null or absent),
/// `Err` when it is not an object (the resource is malformed).
struct Within<'l>(&'l Limits, Level);

impl<'de> DeserializeSeed<'de> for Within<'_> {
    type Value = Result<Data, String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Within<'_> {
    type Value = Result<Data, String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object or null")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Ok(Data::default()))
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Ok(Data::default()))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let Within(limits, level) = self;
        let mut data = Ok(Data::default());
        while let Some(key) = map.next_key::<String>()? {
            match (level, key.as_str()) {
                (Level::Spec, "data") => data = map.next_value_seed(Within(limits, Level::Data))?,
                (Level::Data, "event_channels" | "event_sources") => {
                    let Ok((entries, skipped)) = map.next_value_seed(Entries(limits))? else {
                        data = Err(format!("spec.data.{key} is not an object"));
                        continue;
                    };
                    let Ok(d) = &mut data else {
                        continue;
                    };
                    d.skipped += skipped;
                    if key == "event_channels" {
                        d.channels = entries;
                    } else {
                        d.sources = entries;
                    }
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(data)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(self.not_an_object())
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(self.not_an_object())
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(self.not_an_object())
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(self.not_an_object())
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(self.not_an_object())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(self.not_an_object())
    }
}

impl Within<'_> {
    fn not_an_object(&self) -> Result<Data, String> {
        Err(match self.1 {
            Level::Spec => "spec is not an object".to_owned(),
            Level::Data => "spec.data is not an object".to_owned(),
        })
    }
}

/// Reads one of the two maps: at most `max_channel_entries` entries kept, keys within
/// `max_key_bytes`, values within `max_value_bytes` (the others skipped and counted);
/// `Err` when it is not an object (null is empty).
struct Entries<'l>(&'l Limits);

type Read = Result<(BTreeMap<String, Box<RawValue>>, u64), ()>;

impl<'de> DeserializeSeed<'de> for Entries<'_> {
    type Value = Read;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Read, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Entries<'_> {
    type Value = Read;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object or null")
    }

    fn visit_unit<E>(self) -> Result<Read, E> {
        Ok(Ok((BTreeMap::new(), 0)))
    }

    fn visit_none<E>(self) -> Result<Read, E> {
        Ok(Ok((BTreeMap::new(), 0)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Read, A::Error> {
        let limits = self.0;
        let (mut kept, mut skipped) = (BTreeMap::new(), 0u64);
        while let Some(key) = map.next_key::<Key>()? {
            let Key(Some(key)) = key else {
                map.next_value::<IgnoredAny>()?;
                skipped += 1;
                continue;
            };
            if kept.len() >= limits.max_channel_entries || key.len() > limits.max_key_bytes {
                map.next_value::<IgnoredAny>()?;
                skipped += 1;
                continue;
            }
            let value: Box<RawValue> = map.next_value()?;
            if value.get().len() > limits.max_value_bytes {
                skipped += 1;
                continue;
            }
            // A key given twice: the last value, as any JSON reader keeps.
            kept.insert(key, value);
        }
        Ok(Ok((kept, skipped)))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Read, E> {
        Ok(Err(()))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Read, E> {
        Ok(Err(()))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Read, E> {
        Ok(Err(()))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Read, E> {
        Ok(Err(()))
    }

    fn visit_str<E>(self, _: &str) -> Result<Read, E> {
        Ok(Err(()))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Read, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Err(()))
    }
}

/// A map key, kept only when it is at most [`MAX_KEY_READ`] bytes (longer keys are
/// never copied: they are over any key bound).
struct Key(Option<String>);

/// The longest key copied while reading (`max_key_bytes` is checked after).
const MAX_KEY_READ: usize = 64 << 10;

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_str<E>(self, s: &str) -> Result<Key, E> {
                Ok(Key((s.len() <= MAX_KEY_READ).then(|| s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::default()
    }

    fn nested(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    #[test]
    fn depth_in_fields_not_read_costs_nothing() {
        let text = format!(
            r#"{{"metadata":{{"name":"zz","resourceVersion":"5","managedFields":[{{"fieldsV1":{deep}}}]}},
               "spec":{{"data":{{"model_cards":{{"x":{deep}}},"event_channels":{{"k":{{"a":1}}}}}}}}}}"#,
            deep = nested(10_000)
        );
        let r = resource(&text, &limits());
        assert_eq!(
            (r.name.as_deref(), r.version.as_deref()),
            (Some("zz"), Some("5"))
        );
        let data = r.data.unwrap();
        assert_eq!(data.channels.len(), 1);
        assert_eq!(data.channels["k"].get(), r#"{"a":1}"#);
    }

    #[test]
    fn a_bad_item_is_one_malformed_resource_never_a_failed_page() {
        let text = format!(
            r#"{{"metadata":{{"continue":"c1","resourceVersion":"9"}},"items":[
                {{"metadata":{{"name":"a","resourceVersion":"1"}},"spec":{{"data":{{"event_channels":{deep}}}}}}},
                {{"metadata":{{"name":"b","resourceVersion":"2"}},"spec":{{"data":"text"}}}},
                {{"metadata":{{"name":"c","resourceVersion":"3"}},"spec":{{"data":{{"event_channels":{{"k":1}}}}}}}}]}}"#,
            deep = nested(200)
        );
        let page = page(&text, &limits()).unwrap();
        assert_eq!(page.continue_token.as_deref(), Some("c1"));
        assert_eq!(page.version.as_deref(), Some("9"));
        let names: Vec<_> = page.items.iter().map(|r| r.name.clone().unwrap()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        // A list where a map is expected: not an object (its depth never read).
        assert!(page.items[0].data.is_err());
        assert_eq!(
            page.items[1].data.as_ref().unwrap_err(),
            "spec.data is not an object"
        );
        assert_eq!(page.items[2].data.as_ref().unwrap().channels.len(), 1);
    }

    #[test]
    fn entries_past_a_bound_are_skipped_while_reading() {
        let mut l = limits();
        l.max_channel_entries = 2;
        l.max_key_bytes = 3;
        l.max_value_bytes = 4;
        let text = r#"{"metadata":{"name":"n"},"spec":{"data":{"event_channels":
            {"a":1,"long":2,"b":"12345","c":3,"d":4},"event_sources":null}}}"#;
        let data = resource(text, &l).data.unwrap();
        assert_eq!(data.channels.keys().collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(data.skipped, 3);
    }

    #[test]
    fn unreadable_metadata_leaves_no_name() {
        let r = resource(r#"{"metadata":{"name":7}}"#, &limits());
        assert!(r.name.is_none() && r.data.is_err());
        let r = resource("not json", &limits());
        assert!(r.name.is_none());
    }

    #[tokio::test]
    async fn lines_and_pages_are_capped_before_they_are_held() {
        let body = |s: &'static [u8]| -> Pin<Box<dyn AsyncBufRead + Send>> {
            Box::pin(futures_util::io::Cursor::new(s))
        };
        let mut b = body(b"ab\ncdef\n");
        let mut line = Vec::new();
        assert!(read_line_capped(&mut b, &mut line, 3).await.unwrap());
        assert_eq!(line, b"ab");
        assert!(read_line_capped(&mut b, &mut line, 3).await.is_err());
        let mut b = body(b"xy");
        assert!(read_line_capped(&mut b, &mut line, 3).await.unwrap());
        assert_eq!(line, b"xy");
        assert!(!read_line_capped(&mut b, &mut line, 3).await.unwrap());
        assert_eq!(read_capped(body(b"1234"), 4).await.unwrap(), "1234");
        assert!(read_capped(body(b"12345"), 4).await.is_err());
    }
}
