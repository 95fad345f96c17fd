//! Instruments built from a [`MetricDef`]: its name, unit and description, and the histogram
//! buckets its unit calls for.

use opentelemetry::global;
use opentelemetry::metrics::{
    AsyncInstrument, Counter, Histogram, Meter, ObservableGauge, ObservableUpDownCounter,
};

use super::{InstrumentKind, MetricDef};

/// The meter every Nomad instrument comes from (a no-op meter while metrics are off).
pub fn meter() -> Meter {
    global::meter("nomad")
}

/// Histogram buckets suited to the unit: seconds span 100 µs to 5 min, counts are powers of two.
fn boundaries(unit: &str) -> Vec<f64> {
    match unit {
        "s" => vec![
            0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        ],
        _ => (0..=10).map(|i| f64::from(1u32 << i)).collect(),
    }
}

impl MetricDef {
    fn check(&self, kind: InstrumentKind) {
        debug_assert_eq!(self.kind, kind, "{} is a {:?}", self.name, self.kind);
    }

    pub fn u64_counter(&self) -> Counter<u64> {
        self.check(InstrumentKind::Counter);
        meter()
            .u64_counter(self.name)
            .with_unit(self.unit)
            .with_description(self.description)
            .build()
    }

    pub fn f64_histogram(&self) -> Histogram<f64> {
        self.check(InstrumentKind::Histogram);
        meter()
            .f64_histogram(self.name)
            .with_unit(self.unit)
            .with_description(self.description)
            .with_boundaries(boundaries(self.unit))
            .build()
    }

    pub fn u64_histogram(&self) -> Histogram<u64> {
        self.check(InstrumentKind::Histogram);
        meter()
            .u64_histogram(self.name)
            .with_unit(self.unit)
            .with_description(self.description)
            .with_boundaries(boundaries(self.unit))
            .build()
    }

    pub fn f64_observable_counter(
        &self,
        callback: impl Fn(&dyn AsyncInstrument<f64>) + Send + Sync + 'static,
    ) -> opentelemetry::metrics::ObservableCounter<f64> {
        self.check(InstrumentKind::ObservableCounter);
        meter()
            .f64_observable_counter(self.name)
            .with_unit(self.unit)
            .with_description(self.description)
            .with_callback(callback)
            .build()
    }

    pub fn i64_observable_up_down_counter(
        &self,
        callback: impl Fn(&dyn AsyncInstrument<i64>) + Send + Sync + 'static,
    ) -> ObservableUpDownCounter<i64> {
        self.check(InstrumentKind::ObservableUpDownCounter);
        meter()
            .i64_observable_up_down_counter(self.name)
            .with_unit(self.unit)
            .with_description(self.description)
            .with_callback(callback)
            .build()
    }

    pub fn f64_observable_gauge(
        &self,
        callback: impl Fn(&dyn AsyncInstrument<f64>) + Send + Sync + 'static,
    ) -> ObservableGauge<f64> {
        self.check(InstrumentKind::ObservableGauge);
        meter()
            .f64_observable_gauge(self.name)
            .with_unit(self.unit)
            .with_description(self.description)
            .with_callback(callback)
            .build()
    }
}
