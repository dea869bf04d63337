//! Latency histograms (nanoseconds, HdrHistogram with 3 significant digits), merged across
//! workers, and their summaries.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// The largest latency recorded exactly; longer ones are clamped to it (and counted).
pub const MAX_LATENCY_NS: u64 = 60_000_000_000;

/// A latency histogram in nanoseconds.
#[derive(Debug, Clone)]
pub struct LatencyHist {
    h: Histogram<u64>,
    clamped: u64,
}

impl Default for LatencyHist {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHist {
    /// An empty histogram covering 1 ns to 60 s with 3 significant digits.
    pub fn new() -> Self {
        let h = Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3)
            .unwrap_or_else(|_| Histogram::new(3).unwrap_or_else(|_| unreachable_hist()));
        LatencyHist { h, clamped: 0 }
    }

    /// Records one latency.
    #[inline]
    pub fn record(&mut self, ns: u64) {
        let v = ns.clamp(1, MAX_LATENCY_NS);
        if v != ns && ns > MAX_LATENCY_NS {
            self.clamped += 1;
        }
        // In range by construction, so this cannot fail.
        let _ = self.h.record(v);
    }

    /// Records `n` samples of one latency.
    pub fn record_n(&mut self, ns: u64, n: u64) {
        let v = ns.clamp(1, MAX_LATENCY_NS);
        if ns > MAX_LATENCY_NS {
            self.clamped += n;
        }
        // In range by construction, so this cannot fail.
        let _ = self.h.record_n(v, n);
    }

    /// Adds every sample of `other`.
    pub fn merge(&mut self, other: &LatencyHist) {
        // Both have the same bounds, so this cannot fail.
        let _ = self.h.add(&other.h);
        self.clamped += other.clamped;
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.h.len()
    }

    /// The value at quantile `q` (0..=1) in nanoseconds; 0 when empty.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.h.is_empty() {
            0
        } else {
            self.h.value_at_quantile(q)
        }
    }

    /// Summary in microseconds.
    pub fn summary(&self) -> LatencySummary {
        let us = |ns: u64| ns as f64 / 1e3;
        if self.h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            samples: self.h.len(),
            min_us: us(self.h.min()),
            avg_us: self.h.mean() / 1e3,
            stdev_us: self.h.stdev() / 1e3,
            p50_us: us(self.quantile_ns(0.50)),
            p90_us: us(self.quantile_ns(0.90)),
            p99_us: us(self.quantile_ns(0.99)),
            p999_us: us(self.quantile_ns(0.999)),
            p9999_us: us(self.quantile_ns(0.9999)),
            max_us: us(self.h.max()),
            clamped: self.clamped,
        }
    }
}

fn unreachable_hist() -> Histogram<u64> {
    // Histogram::new(3) only fails for more than 5 significant digits.
    Histogram::new(2).unwrap_or_else(|_| std::process::abort())
}

/// Latency statistics in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub samples: u64,
    /// Minimum.
    pub min_us: f64,
    /// Mean.
    pub avg_us: f64,
    /// Standard deviation.
    pub stdev_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// 99.99th percentile.
    pub p9999_us: f64,
    /// Maximum.
    pub max_us: f64,
    /// Samples longer than 60 s, recorded as 60 s.
    pub clamped: u64,
}

impl LatencySummary {
    /// Whether min <= p50 <= p90 <= p99 <= p99.9 <= p99.99 <= max and min <= avg <= max.
    pub fn is_ordered(&self) -> bool {
        let v = [
            self.min_us,
            self.p50_us,
            self.p90_us,
            self.p99_us,
            self.p999_us,
            self.p9999_us,
            self.max_us,
        ];
        v.windows(2).all(|w| w[0] <= w[1])
            && self.min_us <= self.avg_us
            && self.avg_us <= self.max_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut h = LatencyHist::new();
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        let s = h.summary();
        assert_eq!(s.samples, 10_000);
        assert!((s.p50_us - 5000.0).abs() / 5000.0 < 0.002, "{s:?}");
        assert!((s.p99_us - 9900.0).abs() / 9900.0 < 0.002, "{s:?}");
        assert!((s.avg_us - 5000.5).abs() / 5000.0 < 0.002, "{s:?}");
        assert!(s.is_ordered());
    }

    #[test]
    fn merging_equals_recording_everything_in_one() {
        let mut a = LatencyHist::new();
        let mut b = LatencyHist::new();
        let mut all = LatencyHist::new();
        for i in 0..5000u64 {
            let v = 1000 + (i * 7919) % 100_000;
            if i % 3 == 0 {
                a.record(v);
            } else {
                b.record(v * 10);
            }
            all.record(if i % 3 == 0 { v } else { v * 10 });
        }
        let mut merged = LatencyHist::new();
        merged.merge(&a);
        merged.merge(&b);
        assert_eq!(merged.count(), a.count() + b.count());
        assert_eq!(merged.summary(), all.summary());
        assert!(merged.summary().p99_us > a.summary().p99_us);
    }

    #[test]
    fn empty_and_clamped() {
        let h = LatencyHist::new();
        assert_eq!(h.summary(), LatencySummary::default());
        assert_eq!(h.quantile_ns(0.5), 0);
        let mut h = LatencyHist::new();
        h.record(0);
        h.record(MAX_LATENCY_NS * 2);
        let s = h.summary();
        assert_eq!(s.samples, 2);
        assert_eq!(s.clamped, 1);
        assert!(s.max_us >= 59e6);
    }

    #[test]
    fn disorder_is_detected() {
        let s = LatencySummary {
            samples: 1,
            min_us: 1.0,
            avg_us: 2.0,
            p50_us: 3.0,
            p90_us: 2.0,
            p99_us: 4.0,
            p999_us: 4.0,
            p9999_us: 4.0,
            max_us: 4.0,
            ..Default::default()
        };
        assert!(!s.is_ordered());
    }
}
