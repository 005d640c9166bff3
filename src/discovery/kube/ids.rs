//! Dynamo's instance ids on Kubernetes: SipHash-1-3 with keys (0, 0) over a resource
//! name's bytes followed by one `0xFF` (how Rust's `Hash` writes a `str`), masked to
//! 53 bits so the id survives JSON numbers parsed as doubles.

use crate::discovery::MAX_PUBLISHER_ID;

/// The instance id Dynamo 1.6.1 gives the `Endpoint` and `Model` records of the
/// `DynamoWorkerMetadata` resource named `resource_name` (in pod mode the pod's name,
/// in container mode `{pod}-{container}`). A Dynamo worker on Kubernetes uses it as
/// its worker id; [`KubeDiscovery::instance_id`](super::KubeDiscovery::instance_id)
/// gives this process's.
///
/// ```
/// use eventplane::discovery::kube_instance_id;
/// assert_eq!(kube_instance_id("worker-0"), 0x43710f49c0cff);
/// assert_eq!(kube_instance_id("worker-0-engine-0"), 0x1c9a5dad7b0253);
/// ```
pub fn kube_instance_id(resource_name: &str) -> u64 {
    let mut h = SipHash13::new();
    h.write(resource_name.as_bytes());
    h.write(&[0xff]);
    h.finish() & MAX_PUBLISHER_ID
}

/// SipHash-1-3 (one compression round per block, three finalization rounds) with
/// both keys zero.
struct SipHash13 {
    v: [u64; 4],
    tail: u64,
    ntail: usize,
    length: usize,
}

impl SipHash13 {
    fn new() -> SipHash13 {
        SipHash13 {
            v: [
                0x736f_6d65_7073_6575,
                0x646f_7261_6e64_6f6d,
                0x6c79_6765_6e65_7261,
                0x7465_6462_7974_6573,
            ],
            tail: 0,
            ntail: 0,
            length: 0,
        }
    }

    fn round(&mut self) {
        let [v0, v1, v2, v3] = &mut self.v;
        *v0 = v0.wrapping_add(*v1);
        *v1 = v1.rotate_left(13) ^ *v0;
        *v0 = v0.rotate_left(32);
        *v2 = v2.wrapping_add(*v3);
        *v3 = v3.rotate_left(16) ^ *v2;
        *v0 = v0.wrapping_add(*v3);
        *v3 = v3.rotate_left(21) ^ *v0;
        *v2 = v2.wrapping_add(*v1);
        *v1 = v1.rotate_left(17) ^ *v2;
        *v2 = v2.rotate_left(32);
    }

    fn block(&mut self, m: u64) {
        self.v[3] ^= m;
        self.round();
        self.v[0] ^= m;
    }

    fn write(&mut self, bytes: &[u8]) {
        self.length += bytes.len();
        for &b in bytes {
            self.tail |= u64::from(b) << (8 * self.ntail);
            self.ntail += 1;
            if self.ntail == 8 {
                let m = self.tail;
                self.block(m);
                self.tail = 0;
                self.ntail = 0;
            }
        }
    }

    fn finish(mut self) -> u64 {
        // The length's low byte goes into the top byte of the last block.
        let last = ((self.length as u64 & 0xff) << 56) | self.tail;
        self.block(last);
        self.v[2] ^= 0xff;
        for _ in 0..3 {
            self.round();
        }
        let [v0, v1, v2, v3] = self.v;
        v0 ^ v1 ^ v2 ^ v3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_ids_dynamo_wrote() {
        // From the captured requests (../shared/fixtures/dynamo-1.6.1-kube).
        assert_eq!(kube_instance_id("worker-0"), 0x43710f49c0cff);
        assert_eq!(kube_instance_id("worker-0"), 1_186_445_869_714_687);
        assert_eq!(kube_instance_id("worker-0-engine-0"), 0x1c9a5dad7b0253);
        assert_eq!(kube_instance_id("worker-0-engine-0"), 8_051_026_481_054_291);
    }

    #[test]
    fn matches_the_standard_librarys_sip13_with_zero_keys() {
        // std's DefaultHasher is SipHash-1-3 with zero keys today (not promised):
        // a cross-check over names of every length class, not the reference.
        use std::hash::{Hash, Hasher};
        for len in 0..40 {
            let name: String = (0..len)
                .map(|i| char::from(b'a' + (i % 26) as u8))
                .collect();
            let mut std_hasher = std::hash::DefaultHasher::new();
            name.hash(&mut std_hasher);
            assert_eq!(
                kube_instance_id(&name),
                std_hasher.finish() & MAX_PUBLISHER_ID,
                "{name:?}"
            );
        }
    }
}
