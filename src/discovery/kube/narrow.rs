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
    /// `metadata.creationTimestamp` (RFC 3339, set by the server: the resource's age).
    pub(crate) created: Option<String>,
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
    #[serde(rename = "creationTimestamp")]
    creation_timestamp: Option<String>,
}

#[derive(Deserialize)]
struct OwnerReference {
    kind: Option<String>,
    name: Option<String>,
    uid: Option<String>,
}

/// The longest creation timestamp kept (RFC 3339 with nanoseconds is 35 bytes).
const MAX_TIMESTAMP_BYTES: usize = 64;

impl Meta {
    fn created(&self) -> Option<String> {
        self.creation_timestamp
            .clone()
            .filter(|t| t.len() <= MAX_TIMESTAMP_BYTES)
    }

    fn owner(&self) -> Option<PodRef> {
        self.owner_references.as_ref()?.iter().find_map(|o| {
            let (Some("Pod"), Some(name), Some(uid)) = (o.kind.as_deref(), &o.name, &o.uid) else {
                return None;
            };
            plausible(name, uid).then(|| PodRef {
                name: name.clone(),
                uid: uid.clone(),
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
                created: meta.created(),
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

/// A page split into its items (at most the `limit` asked for: a server answering
/// more is refused before it costs more than that many pointers).
struct RawPage<'a> {
    items: Vec<&'a RawValue>,
    metadata: ListMeta,
}

struct PageSeed(usize);

impl<'de> DeserializeSeed<'de> for PageSeed {
    type Value = RawPage<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawPage<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for PageSeed {
    type Value = RawPage<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawPage<'de>, A::Error> {
        let mut page = RawPage {
            items: Vec::new(),
            metadata: ListMeta::default(),
        };
        while let Some(key) = map.next_key::<&'de str>()? {
            match key {
                "items" => page.items = map.next_value_seed(Items(self.0))?,
                "metadata" => page.metadata = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(page)
    }
}

/// A list's items, as text, at most so many (`null` is none).
struct Items(usize);

impl<'de> DeserializeSeed<'de> for Items {
    type Value = Vec<&'de RawValue>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Items {
    type Value = Vec<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of objects")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            if items.len() == self.0 {
                return Err(serde::de::Error::custom(format_args!(
                    "a page of more than the {} items asked for",
                    self.0
                )));
            }
            items.push(item);
        }
        Ok(items)
    }
}

#[derive(Deserialize, Default)]
struct ListMeta {
    #[serde(rename = "continue")]
    continue_token: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
}

/// Reads a list page: split into items first (a `null` list is empty; more than
/// `max_items` fail the page), then each read on its own.
pub(crate) fn page(
    text: &str,
    max_items: usize,
    limits: &Limits,
) -> Result<Page, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let raw = PageSeed(max_items).deserialize(&mut de)?;
    de.end()?;
    Ok(Page {
        items: raw
            .items
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
/// holding more than that; `false` at the end of the body (a last line without its
/// newline is dropped: a body cut short, the watch is opened again).
pub(crate) async fn read_line_capped(
    body: &mut Pin<Box<dyn AsyncBufRead + Send>>,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<bool> {
    line.clear();
    loop {
        let buf = body.fill_buf().await?;
        if buf.is_empty() {
            return Ok(false);
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

/// `FileTooLarge`: what [`is_too_long`] recognizes.
fn too_long(what: &str, max: usize) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::FileTooLarge,
        format!("{what} longer than {max} bytes"),
    )
}

/// Whether `e` is a page or a line over its bound.
pub(crate) fn is_too_long(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::FileTooLarge
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
            created: meta.created(),
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
                    let only = match (&data, key.as_str()) {
                        (Ok(d), "event_sources") if !d.channels.is_empty() => Some(&d.channels),
                        _ => None,
                    };
                    let Ok((entries, skipped)) = map.next_value_seed(Entries(limits, only))? else {
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
/// `max_key_bytes`, values within `max_value_bytes` (the others skipped and counted,
/// never copied); `Err` when it is not an object (null is empty). With `only` (the
/// channels, read first: Kubernetes writes keys sorted), only their keys are kept and
/// the others are skipped uncounted (sources of no channel are read by nothing).
struct Entries<'l>(&'l Limits, Option<&'l BTreeMap<String, Box<RawValue>>>);

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
        let Entries(limits, only) = self;
        let (mut kept, mut skipped) = (BTreeMap::new(), 0u64);
        while let Some(key) = map.next_key_seed(KeySeed(limits.max_key_bytes))? {
            let wanted = match (&key, only) {
                (Some(k), Some(only)) => only.contains_key(k),
                _ => true,
            };
            let Some(key) = key.filter(|_| wanted && kept.len() < limits.max_channel_entries)
            else {
                map.next_value::<IgnoredAny>()?;
                skipped += u64::from(wanted);
                continue;
            };
            // Borrowed from the text: its length is checked before it is copied.
            let value: &RawValue = map.next_value()?;
            if value.get().len() > limits.max_value_bytes {
                skipped += 1;
                continue;
            }
            // A key given twice: the last value, as any JSON reader keeps.
            kept.insert(key, value.to_owned());
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

/// A map key, copied only when it is at most so many bytes (`None` otherwise).
struct KeySeed(usize);

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E>(self, s: &str) -> Result<Option<String>, E> {
        Ok((s.len() <= self.0).then(|| s.to_owned()))
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
        let page = page(&text, 3, &limits()).unwrap();
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
    fn a_page_of_more_items_than_asked_for_is_refused() {
        let text = r#"{"items":[{},{},{}],"metadata":{}}"#;
        assert!(page(text, 2, &limits()).is_err());
        assert_eq!(page(text, 3, &limits()).unwrap().items.len(), 3);
        assert!(
            page(r#"{"items":null}"#, 3, &limits())
                .unwrap()
                .items
                .is_empty()
        );
    }

    #[test]
    fn sources_are_read_for_the_channels_kept() {
        let mut l = limits();
        l.max_channel_entries = 2;
        let text = r#"{"spec":{"data":{"event_channels":{"k":1,"z":2},
            "event_sources":{"a":0,"b":0,"c":0,"k":3,"z":4}}}}"#;
        let data = resource(text, &l).data.unwrap();
        assert_eq!(data.sources.keys().collect::<Vec<_>>(), ["k", "z"]);
        assert_eq!(data.skipped, 0);
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
        // A body cut short: its last line is dropped.
        let mut b = body(b"xy");
        assert!(!read_line_capped(&mut b, &mut line, 3).await.unwrap());
        assert_eq!(read_capped(body(b"1234"), 4).await.unwrap(), "1234");
        assert!(read_capped(body(b"12345"), 4).await.is_err());
    }
}
