//! Configuration of `EtcdDiscovery`.

use std::time::Duration;

use crate::config::{self, ConfigError};

/// The default key prefix.
pub(crate) const DEFAULT_PREFIX: &str = "/eventplane";

/// Settings of an [`EtcdDiscovery`](super::EtcdDiscovery), validated once by
/// [`EtcdDiscoveryBuilder::connect`](super::EtcdDiscoveryBuilder::connect).
#[derive(Debug, Clone)]
pub(crate) struct EtcdConfig {
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) lease_ttl: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) watch_buffer: usize,
    pub(crate) page_size: usize,
    pub(crate) max_value_bytes: usize,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) credentials: Option<(String, Password)>,
    pub(crate) dialect: crate::wire::Dialect,
    /// Dynamo's records' settings; `None` until `records` is called.
    pub(crate) records: Option<crate::discovery::DynamoRecords>,
}

/// A password that never shows in `Debug` output.
#[derive(Clone)]
pub(crate) struct Password(pub(crate) String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl EtcdConfig {
    pub(crate) fn new(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            prefix: DEFAULT_PREFIX.to_owned(),
            lease_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            watch_buffer: 1024,
            page_size: 1000,
            max_value_bytes: 64 * 1024,
            backoff_min: Duration::from_millis(250),
            backoff_max: Duration::from_secs(5),
            credentials: None,
            dialect: crate::wire::Dialect::EventPlane,
            records: None,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field, reason: String| Err(ConfigError::Invalid { field, reason });
        if self.endpoints.is_empty() {
            return invalid("endpoints", "no etcd endpoint given".to_owned());
        }
        if let Some(e) = self.endpoints.iter().find(|e| e.trim().is_empty()) {
            return invalid("endpoints", format!("empty etcd endpoint {e:?}"));
        }
        if !self.prefix.starts_with('/') || self.prefix.ends_with('/') || self.prefix.len() < 2 {
            return invalid(
                "prefix",
                format!(
                    "{:?} must start with '/', not end with '/', and not be \"/\"",
                    self.prefix
                ),
            );
        }
        if self.lease_ttl < Duration::from_secs(2)
            || self.lease_ttl > Duration::from_secs(3600)
            || self.lease_ttl.subsec_nanos() != 0
        {
            return Err(ConfigError::OutOfRange {
                field: "lease_ttl",
                reason: "must be whole seconds within 2 s ..= 1 h (etcd counts whole seconds)",
            });
        }
        config::nonzero_duration("connect_timeout", self.connect_timeout)?;
        config::nonzero_duration("request_timeout", self.request_timeout)?;
        config::backoff_range("backoff", self.backoff_min, self.backoff_max)?;
        config::nonzero("watch_buffer", self.watch_buffer)?;
        config::nonzero("page_size", self.page_size)?;
        config::nonzero("max_value_bytes", self.max_value_bytes)?;
        if let Some(d) = &self.records {
            if self.dialect != crate::wire::Dialect::Dynamo {
                return invalid(
                    "records",
                    "Dynamo's records need dialect(Dialect::Dynamo)".to_owned(),
                );
            }
            if d.endpoint.as_deref() == Some("") {
                return invalid("records", "empty Dynamo endpoint".to_owned());
            }
        }
        Ok(())
    }

    /// Whole seconds, as etcd grants them.
    pub(crate) fn ttl_secs(&self) -> i64 {
        i64::try_from(self.lease_ttl.as_secs()).unwrap_or(3600)
    }

    /// Keep-alive period: a third of the TTL.
    pub(crate) fn keepalive_every(&self) -> Duration {
        self.lease_ttl / 3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_debug_output() {
        let mut c = EtcdConfig::new(vec!["http://127.0.0.1:2379".to_owned()]);
        c.credentials = Some(("root".to_owned(), Password("hunter2".to_owned())));
        let shown = format!("{c:?}");
        assert!(
            shown.contains("root") && !shown.contains("hunter2"),
            "{shown}"
        );
    }

    #[test]
    fn defaults_are_valid_and_bad_values_are_rejected() {
        let ok = EtcdConfig::new(vec!["http://127.0.0.1:2379".to_owned()]);
        assert!(ok.validate().is_ok());
        assert_eq!(
            ok.keepalive_every(),
            Duration::from_millis(3333) + Duration::from_nanos(333_333)
        );
        type Mutation = Box<dyn Fn(&mut EtcdConfig)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("endpoints", Box::new(|c| c.endpoints.clear())),
            ("endpoints", Box::new(|c| c.endpoints.push(" ".to_owned()))),
            ("prefix", Box::new(|c| c.prefix = "eventplane".to_owned())),
            ("prefix", Box::new(|c| c.prefix = "/eventplane/".to_owned())),
            ("prefix", Box::new(|c| c.prefix = "/".to_owned())),
            (
                "lease_ttl",
                Box::new(|c| c.lease_ttl = Duration::from_secs(1)),
            ),
            (
                "lease_ttl",
                Box::new(|c| c.lease_ttl = Duration::from_millis(2500)),
            ),
            (
                "connect_timeout",
                Box::new(|c| c.connect_timeout = Duration::ZERO),
            ),
            (
                "request_timeout",
                Box::new(|c| c.request_timeout = Duration::ZERO),
            ),
            (
                "backoff",
                Box::new(|c| c.backoff_max = Duration::from_millis(1)),
            ),
            ("backoff", Box::new(|c| c.backoff_min = Duration::ZERO)),
            ("watch_buffer", Box::new(|c| c.watch_buffer = 0)),
            ("page_size", Box::new(|c| c.page_size = 0)),
            ("max_value_bytes", Box::new(|c| c.max_value_bytes = 0)),
        ];
        for (field, mutate) in cases {
            let mut c = ok.clone();
            mutate(&mut c);
            assert_eq!(c.validate().map_err(|e| e.field()), Err(field), "{c:?}");
        }
    }
}
