"""Auto-registration hook: Spark finds `pyspark_<name>.DefaultSource`, so
`spark.read.format("hastream")` works without `spark_publisher.register(spark)`."""

from spark_publisher.source import HAStreamDataSource as DefaultSource

__all__ = ["DefaultSource"]
