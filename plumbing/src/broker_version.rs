//! The RabbitMQ version a connection talks to, from the server properties of `connection.start`,
//! for the features that only some versions understand.

use lapin::Connection;
use lapin::types::AMQPValue;

/// A broker's `major.minor.patch` (pre-release and build suffixes ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BrokerVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

/// The first version whose `basic.consume` takes `x-consumer-timeout`.
pub const CONSUMER_TIMEOUT_ARGUMENT: BrokerVersion = BrokerVersion {
    major: 3,
    minor: 11,
    patch: 15,
};

impl BrokerVersion {
    /// Parses `3.13.7`, `4.3.1`, `4.3.0-rc.1`, `4.2`; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        let core = s.trim().split(['-', '+', ' ']).next()?;
        let mut parts = core.split('.').map(|p| p.parse::<u32>());
        let major = parts.next()?.ok()?;
        let minor = parts.next().unwrap_or(Ok(0)).ok()?;
        let patch = parts.next().unwrap_or(Ok(0)).ok()?;
        Some(Self {
            major,
            minor,
            patch,
        })
    }

    /// The version `conn`'s broker announced (`None` if it sent none, or one that does not
    /// parse: callers then assume the oldest behaviour).
    pub fn of(conn: &Connection) -> Option<Self> {
        let props = conn.configuration().server_properties();
        match props.inner().get("version")? {
            AMQPValue::LongString(s) => Self::parse(&String::from_utf8_lossy(s.as_bytes())),
            AMQPValue::ShortString(s) => Self::parse(s.as_str()),
            _ => None,
        }
    }

    /// Whether `basic.consume` takes the `x-consumer-timeout` argument (a per-consumer delivery
    /// acknowledgement timeout): 3.11.15 and later. Older brokers ignore unknown consumer
    /// arguments on classic queues, but not every queue type promises to.
    pub fn supports_consumer_timeout_argument(self) -> bool {
        self >= CONSUMER_TIMEOUT_ARGUMENT
    }
}

impl std::fmt::Display for BrokerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_compare() {
        let v = |s| BrokerVersion::parse(s).unwrap();
        assert_eq!(v("3.10.7").to_string(), "3.10.7");
        assert_eq!(v("4.3.0-rc.1"), v("4.3.0"));
        assert_eq!(v("4.2"), v("4.2.0"));
        assert!(v("3.13.7") < v("4.3.1"));
        assert!(v("3.9.29") < v("3.10.0"));
        assert_eq!(BrokerVersion::parse("rabbit"), None);
        assert_eq!(BrokerVersion::parse(""), None);
        assert!(!v("3.10.7").supports_consumer_timeout_argument());
        assert!(!v("3.11.14").supports_consumer_timeout_argument());
        assert!(v("3.11.15").supports_consumer_timeout_argument());
        assert!(v("4.3.1").supports_consumer_timeout_argument());
    }
}
